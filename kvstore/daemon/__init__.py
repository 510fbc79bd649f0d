"""The daemon: threads and I/O around the pure core. The store, tiering, movers, prefetch,
the L4 remote, the L3 manifest, tier set-up, the I/O meter, config, metrics, the gRPC
servicer and `kvstore-server` itself."""
