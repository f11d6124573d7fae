// The client SDK's one source of its own: its version, for a caller that
// wants to log what it linked (kvtier_client_version()).
extern "C" const char* kvtier_client_version() { return "0.1.0"; }
