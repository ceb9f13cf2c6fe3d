"""vpaged.integrations: vpaged memory under other inference engines.

Each engine has its own subpackage (vllm/). An integration may use memory/ and kvcache/; the engine itself
is imported only inside the functions that patch it, so importing vpaged never needs the engine.
"""
