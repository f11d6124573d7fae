kvtier-layer-profile 1
name evolkv-c32-seed1
budgets 32 32 32 32 32 66 32 32 32 32 32 10 32 32 32 32 32 20
