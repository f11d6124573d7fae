kvtier-layer-profile 1
name evolkv-c64-seed1
budgets 80 58 53 53 76
