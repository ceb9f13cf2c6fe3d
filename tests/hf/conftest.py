"""Tests of the transformers integration: VPagedCache, the "vpaged" attention function, prepacked modules
(vpaged/hf/)."""
