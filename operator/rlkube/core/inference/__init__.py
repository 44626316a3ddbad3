"""The inference role (`python -m rlkube.core.inference`): one shell over two engines.

- `shell`: the weight follower (the trainer's events stream -> join, receive, put in effect), the HTTP server
  (/v1/completions, /v1/models, /health), shutdown and the exit code; the same for every engine.
- `engine`: what the shell asks of an engine (join, receive and apply weights, generate, version, checksum).
- `weight_source`: where an engine's updates come from (our versioned group or Fast-LLM's broadcast), chosen once
  when it opens: when the shell has it join, follow announcements and rejoin.
- `native_engine`: `spec.inference.engine: native`, the torch sampler (rlkube.core.inference.sampling) in this process.
- `vllm_engine`: `spec.inference.engine: vllm`, vLLM's AsyncLLM in this process, updated through its workers
  (rlkube.core.inference.vllm_worker).

Pods and `rlkube local` run this package for both engines (lifecycle.environment.role_module); with `vllm` and no
vllm in this interpreter, the shell re-executes itself under RLKUBE_VLLM_PYTHON (vllm_engine).
"""
