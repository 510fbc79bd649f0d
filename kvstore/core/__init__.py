"""The pure core of the daemon: no I/O, threads, clock reads, grpc, redis, torch, kvikio or
cupy (tests/unit/test_import_rules.py holds it to that). The index and its records, the
eviction order, the ghost filter, child counts, usage, the page allocator, request checks,
the placement planner and the error tree. (L4's block frame and breaker live with L4, in
kvstore.daemon.)"""
