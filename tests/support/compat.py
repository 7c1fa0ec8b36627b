"""The compatibility subset (``pytest -m compat``): what ``scripts/compat.sh`` runs on other torch releases.

Every private torch API and FSDP2 behaviour dmuon relies on (dmuon.util.torch_compat), and the main
equivalence cases, in 2-3 minutes on 2 CPU cores. The repository's conftest.py marks these node ids
``compat`` (tests/test_torch_compat.py marks itself); with ``-m compat`` a listed id that is no longer
collected is an error, so a renamed test cannot drop out of the subset unnoticed.
"""

from __future__ import annotations

COMPAT_TESTS = {
    # FSDP2 (1-D) against torch.optim.Muon + torch.optim.AdamW in one process: prepare's layout checks
    # (local_shape_and_offset), the hooks FSDP2 calls after its reduce-scatter (on_reduced_gradient).
    "tests/layouts/test_core_equivalence.py::test_matches_single_process_reference[3]",
    # The gather-then-compute baseline (local_shape_and_offset in baselines/gather.py).
    "tests/layouts/test_core_equivalence.py::test_equals_gather_then_compute_under_fsdp2_settings",
    # Native HSDP: FSDP2's all-reduce across replicas before the hooks.
    "tests/layouts/test_hsdp.py::test_hsdp_matches_single_process_reference[mesh_shape0]",
    "tests/layouts/test_hsdp_replicate.py::test_bf16_mixed_precision_equals_native_hsdp",
    # Gradient accumulation through FSDP2's set_requires_gradient_sync (hooks fire on the last micro-batch).
    "tests/conventions/test_accumulation.py::test_accumulation_matches_one_large_batch",
    # Built before fully_shard (the parameters fully_shard swaps in).
    "tests/layouts/test_build_before_sharding.py::test_built_before_sharding_equals_built_after_bit_for_bit[1d-2-ranks]",
    # dmuon's replicate level: the end-of-backward callback (queue_end_of_backward) and the
    # all-reduce hook refusal (has_all_reduce_hook).
    "tests/layouts/test_hsdp_replicate.py::test_replicate_level_matches_single_process_reference[2x2]",
    "tests/layouts/test_hsdp_replicate.py::test_misuse_is_refused_on_every_rank_naming_the_fix",
    # Pipeline stages: torch's schedules calling FSDP2's reduction by hand (in_backward), groups over a
    # stage's ranks (process_group_count), the replicate level landing there; a stage's data-parallel
    # slice told from a replica's (root_mesh).
    "tests/layouts/test_pipeline.py::test_schedules_equal_one_process[1f1b replicate level]",
    "tests/layouts/test_pipeline.py::test_schedules_equal_one_process[zbv unscaled]",
    # Updates applied in the next forward: FSDPModule.unshard(async_op=True) from forward pre-hooks, on the
    # current stream (the stream checker), FSDP2's pre-forward waiting for it.
    "tests/runtime/test_next_forward.py::test_next_forward_trains_as_in_step_and_as_one_process[1-D]",
    # Tensor parallelism: FSDP2's _StridedShard rows inside TP (strided_shard_type).
    "tests/layouts/test_tp.py::test_tp_fsdp_equals_single_process_torch_muon[dp2-tp2]",
    "tests/layouts/test_tp.py::test_tp_fsdp_equals_single_process_torch_muon[hsdp2x2-tp2]",
    "tests/layouts/test_tp.py::test_returns_in_backward_under_tensor_parallelism",
    # FSDP2's layout APIs (torch 2.12+): fully_shard(dp_mesh_dims=...) over full-mesh DTensor parameters, and
    # ShardPlacementResult's per-parameter meshes inside one FSDP group (gathered_or_gathering over a unit's
    # several groups); dmuon reads the meshes and placements they leave. One 4-rank run serves them all.
    "tests/layouts/test_fsdp_layout_apis.py::test_dense_model_under_dp_mesh_dims_equals_one_process[dims-1d]",
    "tests/layouts/test_fsdp_layout_apis.py::test_dense_model_under_dp_mesh_dims_equals_one_process[dims-1d-two-dims]",
    "tests/layouts/test_fsdp_layout_apis.py::test_dense_model_under_dp_mesh_dims_equals_one_process[dims-hsdp]",
    "tests/layouts/test_fsdp_layout_apis.py::test_dense_model_under_dp_mesh_dims_equals_one_process[dims-hsdp-replicate-last]",
    "tests/layouts/test_fsdp_layout_apis.py::test_dense_momentum_is_held_once_across_the_cluster[dims-1d]",
    "tests/layouts/test_fsdp_layout_apis.py::test_dense_momentum_is_held_once_across_the_cluster[dims-1d-two-dims]",
    "tests/layouts/test_fsdp_layout_apis.py::test_dense_momentum_is_held_once_across_the_cluster[dims-hsdp]",
    "tests/layouts/test_fsdp_layout_apis.py::test_moe_under_dp_mesh_dims_and_per_parameter_meshes_equals_one_process[dims-ep2-dim1]",
    "tests/layouts/test_fsdp_layout_apis.py::test_moe_under_dp_mesh_dims_and_per_parameter_meshes_equals_one_process[dims-ep2-dim0]",
    "tests/layouts/test_fsdp_layout_apis.py::test_moe_under_dp_mesh_dims_and_per_parameter_meshes_equals_one_process[dims-ep2-hsdp]",
    "tests/layouts/test_fsdp_layout_apis.py::test_moe_under_dp_mesh_dims_and_per_parameter_meshes_equals_one_process[placement-ep2-dim1]",
    "tests/layouts/test_fsdp_layout_apis.py::test_moe_under_dp_mesh_dims_and_per_parameter_meshes_equals_one_process[placement-ep2-dim0-uneven]",
    "tests/layouts/test_fsdp_layout_apis.py::test_moe_under_dp_mesh_dims_and_per_parameter_meshes_equals_one_process[placement-ep2-hsdp]",
    "tests/layouts/test_fsdp_layout_apis.py::test_moe_under_dp_mesh_dims_and_per_parameter_meshes_equals_one_process[placement-ep2-hsdp next forward]",
    # Clipping after launches from backward.
    "tests/conventions/test_clip.py::test_launches_survive_clipping[3 ranks]",
    "tests/conventions/test_clip.py::test_launches_survive_clipping[2x2 replicate level]",
    "tests/conventions/test_clip.py::test_clipped_training_matches_one_process[2x2 native HSDP]",
    "tests/conventions/test_clip.py::test_clipping_variants_against_overlap_false[3 ranks-bf16 mixed precision]",
    "tests/conventions/test_clip.py::test_clipping_variants_against_overlap_false[3 ranks-activation checkpointing, a frozen matrix]",
    # DCP checkpoints, and full state dicts that continue in torch.optim.Muon and AdamW.
    "tests/conventions/test_checkpoint.py::test_hsdp_checkpoint_holds_each_momentum_once",
    "tests/conventions/test_checkpoint.py::test_full_state_dicts_continue_in_torch_muon_and_adamw",
    "tests/conventions/test_checkpoint.py::test_resume_on_another_cluster_continues_exactly[hsdp-2x2]",
    "tests/conventions/test_checkpoint.py::test_replicate_level_checkpoint_resumes_on_other_layouts",
    "tests/layouts/test_tp.py::test_dcp_checkpoint_resumes_exactly_on_hsdp_tp",
    # Overlap, NS in backward, returns in backward.
    "tests/runtime/test_overlap.py::test_overlap_is_bit_identical_to_sync[None]",
    "tests/runtime/test_overlap.py::test_overlap_is_bit_identical_to_sync[mesh_shape1]",
    "tests/runtime/test_overlap.py::test_returns_in_backward_give_the_same_bits_as_returns_in_step[None-fsdp2]",
    "tests/runtime/test_overlap.py::test_ns_in_backward_matches_the_reference[mesh_shape1-4]",
    "tests/runtime/test_overlap.py::test_ns_in_backward_matches_the_reference[None-1]",
    "tests/runtime/test_overlap.py::test_returns_in_backward_give_the_same_bits_as_returns_in_step[mesh_shape2-dmuon]",
    # Hooks on a single process (no FSDP2) and their lifetime.
    "tests/runtime/test_launches.py::test_a_launch_stands_only_for_the_gradients_step_uses",
    # dmuon's Newton-Schulz is bit for bit torch.optim.Muon's (torch's private _zeropower_via_newtonschulz).
    "src/dmuon/ortho/tests/test_newton_schulz.py::test_bit_identical_to_torch_muon[5-shape3]",
    "src/dmuon/ortho/tests/test_newton_schulz.py::test_bit_identical_for_bf16_input_and_input_untouched",
}
