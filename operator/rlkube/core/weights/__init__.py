"""Weight updates trainer -> inference servers over a dedicated torch.distributed group (docs/design.md §5.6), in
three parts, each importing only those before it:

- `wire`: the wire format: what one update is (names, dtypes, buckets, the header, the checksum, a full or an
  adapter update, a sharded trainer's streamed update), whatever carries it.
- `group`: the group transport: the hand-built group of trainer rank 0 and the inference servers' ranks, its
  epochs, the sender's and the receivers' side of one broadcast.
- `publication`: the trainer's publication policy (`WeightPublisher`): announce, then transfer; reopen, retry,
  re-announce; overlap a transfer with the next step.

Kept free of imports: a receiver (an inference engine, rlkube.core.inference.vllm_worker) loads no publication policy.
"""
