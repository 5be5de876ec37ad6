"""Ray cluster, placement groups, generic worker groups and named parallel dims; the local N-process launcher
(`launch`) and device-correct scalar collectives (`collectives`). Knows no concrete worker."""
