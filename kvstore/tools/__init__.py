"""Tools on top of the client: `kvstore-admin`, the store demo, and the helpers that start a
real daemon and a real redis-server for tests, benchmarks and demos."""
