"""Tests of the KV-memory simulator (vpaged/sim/)."""
