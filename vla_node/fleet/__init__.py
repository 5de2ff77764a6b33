"""Fleet replay: a library of drives replayed through the real node, one job per (drive, repeat), on Ray or by
shards that any batch system runs (`vla-node fleet run | shard | merge | compare`)."""
