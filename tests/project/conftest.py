"""Tests of the repository as a whole: layers and boundaries, docs, packaging, examples, scripts."""
