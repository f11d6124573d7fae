kvtier-layer-profile 1
name evolkv-c64-seed1
budgets 49 64 79 49 79
