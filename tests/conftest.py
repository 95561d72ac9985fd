"""The `slow` marker: `pytest -m "not slow"` is the quick loop, the full suite is CI's.

`SLOW` lists the tests that took 2 s or more (call and setup together) in a
full run on 2 cores (`pytest --durations=0`); every package still has quick
tests in the loop.  A test added later that is slow can say so itself with
`@pytest.mark.slow`.
"""
from __future__ import annotations

import pytest

SLOW = frozenset({
    'tests/test_adopt.py::test_a_cached_plan_made_for_another_budget_is_not_used',
    'tests/test_adopt.py::test_budget_wrap_trains_a_causal_lm_as_eager_and_caches_its_plans',
    'tests/test_adopt.py::test_compiled_plan_file_verifies_and_trains_as_eager',
    'tests/test_adopt.py::test_trainer_trains_the_wrapped_model_as_the_model',
    'tests/test_autocast.py::test_gpt2_tiny_under_autocast_trains_as_eager',
    'tests/test_autocast.py::test_llama_under_autocast_trains_as_eager',
    'tests/test_autocast.py::test_remat_compile_autocast_and_remat_run',
    'tests/test_autocast.py::test_trainer_bf16_trains_the_wrapped_model_as_the_model',
    'tests/test_bench.py::test_runs_and_writes',
    'tests/test_budgets.py::test_budget[gpt2-tiny-0.3]',
    'tests/test_budgets.py::test_budget[gpt2-tiny-0.5]',
    'tests/test_budgets.py::test_budget[gpt2-tiny-0.7]',
    'tests/test_budgets.py::test_budget[gpt2-tiny-floor]',
    'tests/test_budgets.py::test_budget[hf-gpt2-0.3]',
    'tests/test_budgets.py::test_budget[hf-gpt2-0.5]',
    'tests/test_budgets.py::test_budget[hf-gpt2-0.7]',
    'tests/test_budgets.py::test_budget[hf-gpt2-floor]',
    'tests/test_budgets.py::test_cli_compile_budget_then_run_check',
    'tests/test_checkpoint.py::test_a_model_calling_checkpoint_trains_as_eager[non-reentrant]',
    'tests/test_checkpoint.py::test_a_model_calling_checkpoint_trains_as_eager[reentrant]',
    'tests/test_checkpoint.py::test_a_model_calling_checkpoint_trains_as_eager[sequential]',
    'tests/test_checkpoint.py::test_gpt2_with_gradient_checkpointing_trains_as_eager[False]',
    'tests/test_checkpoint.py::test_gpt2_with_gradient_checkpointing_trains_as_eager[True]',
    'tests/test_cli.py::test_model_file_that_exits_makes_the_command_exit_2',
    'tests/test_cli.py::test_verify_and_run_check_json',
    'tests/test_codegen.py::test_generated_code_has_only_its_own_shapes',
    'tests/test_compile.py::test_compiled_budget_wrap_trains_bitwise_as_uncompiled[aot_eager]',
    'tests/test_compile.py::test_compiled_budget_wrap_trains_bitwise_as_uncompiled[inductor]',
    'tests/test_compile.py::test_compiled_plan_wrap_trains_as_uncompiled_and_eval_calls_are_compiled',
    'tests/test_ddp.py::test_ddp_gradients_equal_unwrapped_ddp_bitwise',
    'tests/test_fidelity.py::test_a_changed_step_is_found',
    'tests/test_fidelity.py::test_a_mask_decision_is_a_guard',
    'tests/test_fidelity.py::test_family_traces_and_trains_as_eager[bart]',
    'tests/test_fidelity.py::test_family_traces_and_trains_as_eager[convnext]',
    'tests/test_fidelity.py::test_family_traces_and_trains_as_eager[llama-lora]',
    'tests/test_fidelity.py::test_family_traces_and_trains_as_eager[llama-padded]',
    'tests/test_fidelity.py::test_family_traces_and_trains_as_eager[llama]',
    'tests/test_fidelity.py::test_family_traces_and_trains_as_eager[mixtral]',
    'tests/test_fidelity.py::test_family_traces_and_trains_as_eager[qwen3-moe]',
    'tests/test_fidelity.py::test_family_traces_and_trains_as_eager[mistral]',
    'tests/test_fidelity.py::test_family_traces_and_trains_as_eager[gemma2]',
    'tests/test_fidelity.py::test_family_traces_and_trains_as_eager[distilbert]',
    'tests/test_fidelity.py::test_family_traces_and_trains_as_eager[modernbert]',
    'tests/test_fidelity.py::test_family_traces_and_trains_as_eager[t5]',
    'tests/test_fidelity.py::test_family_traces_and_trains_as_eager[vit]',
    'tests/test_fidelity.py::test_family_traces_and_trains_as_eager[phi3]',
    'tests/test_fidelity.py::test_family_traces_and_trains_as_eager[mamba]',
    'tests/test_fidelity.py::test_family_traces_and_trains_as_eager[t5-nomask]',
    'tests/test_fidelity.py::test_family_traces_and_trains_as_eager[bart-nomask]',
    'tests/test_fidelity.py::test_family_traces_and_trains_as_eager[whisper]',
    'tests/test_fidelity.py::test_family_traces_and_trains_as_eager[unet]',
    'tests/test_fsdp.py::test_fsdp2_units_run_plans_with_fsdp2s_gradients_bitwise',
    'tests/test_gpu_check.py::test_compile_only_writes_plans',
    'tests/test_gpu_check.py::test_small_run_from_plans',
    'tests/test_gpu_check.py::test_window_script_on_cpu',
    'tests/test_layering.py::test_checker_reports_a_function_level_import_into_another_stage',
    'tests/test_layering.py::test_checker_reports_cvxpy_on_the_runtime_path',
    'tests/test_layering.py::test_runtime_path_imports_no_optimizer',
    'tests/test_literals.py::test_each_literal_is_refused_at_a_line_or_runs[bn.add_]',
    'tests/test_literals.py::test_each_literal_is_refused_at_a_line_or_runs[div]',
    'tests/test_literals.py::test_each_literal_is_refused_at_a_line_or_runs[momentum]',
    'tests/test_literals.py::test_each_literal_is_refused_at_a_line_or_runs[output mask]',
    'tests/test_literals.py::test_each_literal_is_refused_at_a_line_or_runs[pow]',
    'tests/test_literals.py::test_each_literal_is_refused_at_a_line_or_runs[threshold]',
    'tests/test_models.py::test_resnet_mini_plan_gradients_bitwise_equal_to_eager[0.6]',
    'tests/test_models.py::test_resnet_mini_plan_gradients_bitwise_equal_to_eager[None]',
    'tests/test_nesting.py::test_a_plan_nested_1000_deep_exits_2_in_one_line[remat-run]',
    'tests/test_nesting.py::test_a_plan_nested_1000_deep_exits_2_in_one_line[remat-show]',
    'tests/test_nesting.py::test_a_plan_nested_1000_deep_exits_2_in_one_line[remat-verify]',
    'tests/test_optimize.py::test_brute_force_property',
    'tests/test_optimize.py::test_decomposed_plans_fit',
    'tests/test_optimize.py::test_flat_search_below_the_decomposed_floor',
    'tests/test_optimize.py::test_gpt2_tiny',
    'tests/test_optimize.py::test_model_with_some_rows_is_exact_at_those_rows',
    'tests/test_optimize.py::test_stacked_flat_matches_brute_force',
    'tests/test_optimize.py::test_the_same_plan_on_a_loaded_machine[gpt2-tiny, default search]',
    'tests/test_optimize.py::test_the_same_plan_on_a_loaded_machine[stacked12, decomposed, effort full]',
    'tests/test_packaging.py::test_wheel_installs_and_compiles_outside_the_source_tree',
    'tests/test_rewrites.py::test_a_budget_below_every_rung_is_refused_with_the_lowest_floor',
    'tests/test_rewrites.py::test_a_tied_gradient_summed_in_place_is_taken_by_autograd_as_predicted[False]',
    'tests/test_rewrites.py::test_a_tied_gradient_summed_in_place_is_taken_by_autograd_as_predicted[True]',
    'tests/test_rewrites.py::test_batchnorm_split_gives_eager_bits',
    'tests/test_rewrites.py::test_chunked_attention_verifies_round_trips_and_runs_as_predicted',
    'tests/test_rewrites.py::test_chunked_loss_gives_eager_bits_below_the_recompute_floor[backend-tied]',
    'tests/test_rewrites.py::test_chunked_loss_gives_eager_bits_below_the_recompute_floor[backend-untied]',
    'tests/test_rewrites.py::test_chunked_loss_gives_eager_bits_below_the_recompute_floor[wrap-untied]',
    'tests/test_rewrites.py::test_resnet_at_0_4_runs_bitwise_and_as_predicted',
    'tests/test_rewrites.py::test_transformers_heads_keep_their_logits_and_eagers_bits[llama]',
    'tests/test_show.py::test_output_into_a_closed_pipe_exits_quietly',
    'tests/test_text.py::test_lines_of_words_read_as_lark_reads',
    'tests/test_text.py::test_round_trips',
    'tests/test_trunk.py::test_fake_trace_of_gpt2_medium_plans_without_allocating',
    'tests/test_trunk.py::test_gradients_bitwise_equal_with_dropout[examples/hf_gpt2.py]',
    'tests/test_trunk.py::test_gradients_bitwise_equal_with_dropout[gpt2-tiny]',
    'tests/test_trust.py::test_an_edited_plan_is_refused_at_a_line_or_runs_right',
    'tests/test_verify.py::test_budget',
    'tests/test_verify.py::test_compute_dropped',
    'tests/test_verify.py::test_free_dropped_is_a_leak',
    'tests/test_verify.py::test_free_duplicated',
    'tests/test_verify.py::test_free_moved_before_a_use',
    'tests/test_verify.py::test_recompute_of_a_mutating_node_is_rejected',
    'tests/test_verify.py::test_recompute_of_a_random_node_is_accepted',
    'tests/test_verify.py::test_use_of_an_undeclared_value',
    'tests/test_verify.py::test_valid_programs_pass',
    'tests/test_verify.py::test_verify_a_4000_node_program',
    'tests/test_verify.py::test_wrong_node_facts_are_reported_at_the_node',
    'tests/test_verify.py::test_wrong_output_facts_are_reported_at_the_value',
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _no_progress_lines(monkeypatch):
    """`wrap` says on stderr what it is planning when that takes over
    `_PROGRESS_AFTER_S`; whether it does is the machine's load's choice, and
    tests compare stderr exactly, so the line is off here
    (`test_adopt.py::test_planning_that_takes_a_while_says_so` turns it on)."""
    import remat_ir.adopt

    monkeypatch.setattr(remat_ir.adopt, "_PROGRESS_AFTER_S", 1e9)


def pytest_configure(config):
    """Under pytest-xdist (`-n 2`, the README's test command), one torch
    thread per worker: two workers of two threads each on two cores spend
    their time waiting for each other.  Every comparison with eager runs
    both sides in one worker, under one thread count."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
