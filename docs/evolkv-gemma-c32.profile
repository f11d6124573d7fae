kvtier-layer-profile 1
name evolkv-c32-seed1
budgets 32 32 32 32 32 56 32 32 32 32 32 19 32 32 32 32 32 21
