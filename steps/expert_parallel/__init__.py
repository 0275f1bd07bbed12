"""Expert parallelism for training: the dp x ep process mesh, the dispatch backends and gradient sync.

The world of R ranks is a mesh of dp x ep: rank = dp_rank * ep + ep_rank. The ep ranks of one row (an "EP
group") split the experts of every MoE layer between them, E/ep experts each, as the iteration's
`ExpertPlacement` says: per MoE layer, the E global expert ids in slot order, EP rank r holding slots
[r*E/ep, (r+1)*E/ep) (owner of slot s: s // (E/ep)). The identity placement gives contiguous ranges; the
update chooses, per layer, the split that evens out the ranks' routed rows (`balanced_placement`, from the
previous iteration's per-expert row counts). The MoE block maps its router's expert ids to slot ids, so the
dispatch backends only ever see contiguous slot ranges. The dp rows hold the same expert slices ("expert
replicas"). Everything that is not an expert (embeddings, attention, norms, routers, the output
projection) is replicated on all R ranks. Every rank trains on its own slice of the global batch.

  mesh.py       the mesh (Mesh, resolve_ep_size, build_mesh), gradient sync and clipping over it, and the
                small collectives of the trainer's statistics;
  (the placement, ExpertPlacement and balanced_placement, is steps/models/placement.py: the model maps
  router ids to slots with it, and checkpoints read one EP rank's experts by it);
  dispatch.py   make_dispatch: the backend a run names, behind steps.models.moe's one `ExpertDispatch` contract:
                  local     one rank, all experts (steps.models.moe.LocalDispatch);
                  alltoall  alltoall.py, all_to_all_single over gloo (CPU) or NCCL (GPU);
                  deepep    deepep.py, DeepEP 2.x ElasticBuffer, GPU only;
  timing.py     CommTimer, the wall time of the backends' exchanges (the bench reports it).
"""
