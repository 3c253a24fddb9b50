"""Helpers for the peer benchmarks (bench_peer.py): building and running the servers kvprefix is compared with."""
