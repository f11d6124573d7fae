// store_stats HOST:PORT: what an engine linking the installed SDK does
// first, asks a kvtier-store for its usage.
#include <cstdio>

#include "client/store_client.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: store_stats HOST:PORT\n");
    return 2;
  }
  kvtier::StoreClientOptions o;
  o.target = argv[1];
  auto client = kvtier::StoreClient::Connect(o);
  if (!client.ok()) {
    std::fprintf(stderr, "%s\n", client.status().ToString().c_str());
    return 1;
  }
  auto stats = (*client)->Stats();
  if (!stats.ok()) {
    std::fprintf(stderr, "%s\n", stats.status().ToString().c_str());
    return 1;
  }
  std::printf("sessions %llu tenant %s\n", static_cast<unsigned long long>(stats->sessions()),
              stats->tenant().c_str());
  return 0;
}
