"""A pod's first process when it is not one role process: the trainer's ranks (`ranks`), a colocated trainer
pod's two processes (`colocated`) and the Fast-LLM trainer pod's relay in front of torchrun (`fast_llm`). Each
stands for its children as the pod's one process: signals in, one exit code and termination message out
(docs/design.md, the module map). Kept free of imports: a launcher loads no torch."""
