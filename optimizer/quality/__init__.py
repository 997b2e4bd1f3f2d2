"""The quality gate: does a configuration change what the model says?

A configuration that changes numerics (quantized weights, an FP8 KV cache, speculative decoding,
another dtype: :mod:`.levers`) is compared with vLLM's defaults on the same weights
(:mod:`.check`): both answer the same prompts one at a time, the baseline's greedy continuation
is teacher-forced through each server's prompt logprobs, and the candidate's top-1 agreement
and logprob drift are judged against the floor (two passes of the baseline). :mod:`.run` starts
the servers. Every other configuration is unchanged by construction and skips the check; dummy
weights (flat logits) skip it too, never a pass.
"""
