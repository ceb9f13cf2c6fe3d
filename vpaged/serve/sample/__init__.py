"""Sampling: how a request is decoded (params.py: SamplingParams), and each step's next tokens from the logits.

sampler.py            the batched sampler: the controls below, then greedy / temperature, top-k, top-p
logits_processors.py  logit_bias, min_tokens, bad_words bans, per request
penalties.py          repetition, frequency and presence penalties, per request
bad_words.py          bad words as the token sequences the sampler bans
logprobs.py           log probabilities of the chosen (and prompt) tokens under the raw distribution
structured.py         structured output: a grammar's allowed tokens as a mask (xgrammar)
"""
