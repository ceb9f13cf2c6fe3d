"""Tests of the vLLM plugin (vpaged/integrations/)."""
