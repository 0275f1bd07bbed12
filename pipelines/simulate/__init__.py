"""`moerl simulate CONFIG`: a discrete-event model of the run's workflow on a cluster.

It answers sizing questions before a cluster is rented: how long an iteration takes, how many tokens per second
the rollout pool turns out, how much of each GPU pool sits idle, and what asynchronous training (staleness 1)
buys over synchronous training (staleness 0). Both staleness values are always simulated and compared.

The model, in the order a run meets it:

- The DAG is the workflow's own: `pipelines.workflow.graph.run_dependencies` per segment (plan, import-sft, then
  rollout-i x shards -> score-i -> update-i -> publish-i, with staleness 1 letting rollout-(i+1) overlap
  update-i; with rollout servers and deltas, rollout waiting for the update that indexed its version instead of
  its publish, and with the trainer that stays up the next update too), the report exit handler after each
  segment, and the next segment's Workflow after that. Not modelled: a restarted trainer's wait for a version
  it does not hold to be published (answered 503 and retried; only after a crash).
- Pools come from the config's placement. Rollout: a Spot GPU pool of one node per shard (one SGLang engine per
  node), `nvidia.com/gpu` GPUs each. Trainer: an on-demand gang of trainer.nodes nodes that one update takes
  whole. CPU: score and the control steps, never short of room. A config without GPUs is this machine: one node
  on which the local executor starts every ready step at once (the rendered Workflow sets no parallelism).
- Step durations are measured figures (`--step-times`: per-step seconds, or a `moerl local --status-out` status
  that `step_times_from_status` reduces to its median per step kind) or derived from the config and the
  `Assumptions` below. A rollout shard is an engine start-up (model load) followed by its chunks.
- Spot interruptions: a Poisson process per rollout node (X per node-hour). An interrupted node takes its pods
  with it and comes back after `node_replacement_s`; an interrupted shard keeps its finished chunks (they are
  resumable), loses the chunk it was generating, and is requeued after the config's retry backoff; it then
  waits for a free node and pays the engine start-up again. A shard that runs out of retries (limit or
  max_duration) is counted: the real run would have failed there.
- Engines that stay up (rollout.servers > 0, trainer.server; servers.py): per segment, daemon servers that pay
  the engine (or trainer) start-up once and again per replacement; rollout and update steps become clients on
  the CPU pool. A rollout server brings its weights to each new version from bytes and bandwidth (the delta,
  checkpoint.deltas, or the whole checkpoint, from S3; the version from local disk; the in-place update), and
  the update pays the delta's encode and write (every rank its share, every node at once). A reclaimed
  server loses its chunk in flight; its clients are retried and find it (or another) again. rollout.servers 0
  is modelled exactly as before.
- Multi-turn rollouts (a config with an `environment`): a chunk's conversations advance turn by turn, so a chunk
  is the model's tokens, turns x max_new_tokens x response_fill a conversation (response_fill a turn's), decoded at
  the engine's rate, plus each turn's environment steps over environment.workers workers, ceil(conversations /
  workers) x environment_step_s a turn for ceil(turns) turns, on the rollout step's clock. With rollout servers
  the steps are the client's: the server generates other clients' chunks meanwhile. The trainer runs the
  observations too: turns x max_new_tokens x fill + (turns - 1) x observation_tokens after the prompt, at most
  environment.max_total_tokens. `turns` defaults to environment.max_turns (every conversation to its limit).

Iteration time is the time between two successive publications (the first one counted from the end of
import-sft), the same definition that `iteration_times_from_status` applies to a real run. Tokens are sampled
response tokens: prompts_per_iteration x group_size x max_new_tokens x response_fill (x turns with an environment).

Deterministic: one `random.Random(seed)` per simulated run, events ordered by (time, sequence number).

The model: the checkpoint's config.json (the run config's sft_checkpoint through its store, or `--model-config
FILE`) gives parameter counts, a version's bytes and training FLOPs a token (model_sizing.py), which move the
GPU assumptions (written for Qwen3-30B-A3B, what the built-in figures stay when no config.json is readable) to
that model, and the trainer's memory per GPU under the config's EP and DP, printed with whether it fits.

The modules: sizing.py (assumptions, pools, step times), model_sizing.py (the model's sizes), measured.py
(step and iteration times of a real run's status), model.py (the event simulation), state.py (what it tracks),
servers.py (servers and clients), tables.py (the printout), timeline.py (the plot), cli.py.
"""
