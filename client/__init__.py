"""kvstore client library."""
