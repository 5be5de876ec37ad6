"""Ray cluster, placement groups, generic worker groups and named parallel dims. Knows no concrete worker."""
