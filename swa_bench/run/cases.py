"""One case of a scenario: its checks, then both paths measured; models and engines shared.

Models are built once per (model, seed, dtype, device); engines (and their captured graphs) once
per ``EngineConfig``, with one graph configuration's pools held at a time: the runner alone
decides which engine a check or a timed path reuses (``CaseRunner.engine``, ``engine_pair``). A
case that raises is recorded as an error and the sweep goes on.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import traceback
from collections.abc import Callable, Iterator

import torch

from swa_bench.bench.byte_model import WeightFormats, step_costs
from swa_bench.bench.flop_model import precision_split
from swa_bench.bench.measure import FlopCache, TimingSettings, measure_paths
from swa_bench.bench.prompts import prompt_result, time_prompt
from swa_bench.bench.roofline import (
    FP8,
    achieved_tflops,
    copy_bandwidth,
    fp8_gemm_tflops,
    gemm_tflops,
    mfu,
    roofline_ms,
)
from swa_bench.checks import equivalence, selection
from swa_bench.checks import prompts as prompt_checks
from swa_bench.checks.approximation import check_bounds, measure
from swa_bench.checks.comparison import Tolerance
from swa_bench.checks.tasks import TaskRun, TaskSettings, agreement_check, run_tasks
from swa_bench.checks.tolerance import Allowance
from swa_bench.engine.chunked_prompt import ChunkedPrompt
from swa_bench.engine.config import EngineConfig, resolve_kernels
from swa_bench.engine.dispatch import AgreedRoute, StepPlan
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.model import Transformer, build_model
from swa_bench.model.precision import quantised_gemm
from swa_bench.model.weights import load_weights
from swa_bench.results import CaseResult, CaseStatus, CheckResult, KernelRecord, MfuBasis
from swa_bench.scenario import Case, Scenario, ScenarioError
from swa_bench.scenario.schema import PromptEntry

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _finished(result: CaseResult) -> CaseResult:
    """``result`` failed where a check failed."""
    if any(not c.passed for c in result.checks):
        result.status = "failed"
    return result


def case_skeleton(case: Case, status: CaseStatus, error: str | None = None) -> CaseResult:
    """A case's result before anything ran: what it is (id, label, configuration, size); the
    runner fills in the figures, a lost shard worker only the error."""
    sc = case.scenario
    config = case.engine_config()
    return CaseResult(
        case_id=case.case_id, index=case.index, label=case.label(), params=case.params,
        status=status, error=error, graph_mode=sc.graph_mode, policy=sc.policy,
        precision=sc.precision,
        expert_precision=sc.expert_precision if sc.precision == "fp8" else None,
        batch_invariant=sc.checks.batch_invariant,
        trim_threshold=case.trim_threshold(), tokens=case.num_tokens(),
        num_requests=case.num_requests(), batch="",
        kv_block_reuse=config.kv_block_reuse, lora=config.lora,
        prompt_embeds=config.prompt_embeds, prefix_hits=sc.prefix_hits(),
    )


def kernel_record(case: Case, device: torch.device) -> KernelRecord:
    """The kernels ``case`` runs on ``device``, as its result records them (the one place: a
    resumed run compares its finished cases' records with this)."""
    kernels = resolve_kernels(case.engine_config().kernels, device.type)
    return KernelRecord(**kernels.record(),
                        quantised_gemm=quantised_gemm(case.model_args(), kernels))


def resolve_device(scenario: Scenario) -> torch.device:
    """``auto`` takes the GPU when there is one; asking for ``cuda`` without one is bad input."""
    if scenario.device == "cuda" and not torch.cuda.is_available():
        raise ScenarioError(scenario.source_path, "device", "cuda requested but no GPU is visible")
    return torch.device(scenario.device_type())


class CaseRunner:
    """Shares models and engines across the cases of one scenario."""

    def __init__(
        self, scenario: Scenario, *, agree: Callable[[StepPlan], AgreedRoute] | None = None
    ) -> None:
        self.device = resolve_device(scenario)
        self.models: dict[str, Transformer] = {}
        self.engines: dict[tuple[EngineConfig, bool], Engine] = {}
        # Data parallel: the timed engines agree each step's route with the other ranks.
        self.agree = agree
        self.flops = FlopCache()
        # The device's measured GEMM rate, per dtype, and its fp8 one (key ``FP8``: None where
        # it has no fp8 tensor cores) once a case runs fp8 GEMMs.
        self.gemm_tflops: dict[str, float | None] = {}
        self.copy_gbytes_per_s: dict[str, float] = {}  # and its copy bandwidth, per dtype
        self.full_tasks: dict[str, TaskRun] = {}  # the full prefill's task run, per model+settings
        # Checks that read only the model and a few inputs, not the case's policy or graph mode
        # (E4: tolerance, kernels, longest prompt; visibility: kernels, capture sizes, the step),
        # by those inputs: the cases of one model share one run.
        self.shared_checks: dict[str, CheckResult] = {}

    def device_tflops(self, dtype: str, threads: int | None) -> float:
        """This device's GEMM rate in ``dtype``, measured once per run: what MFU is against."""
        if dtype not in self.gemm_tflops:
            self.gemm_tflops[dtype] = gemm_tflops(self.device, DTYPES[dtype], threads=threads)
        return self.gemm_tflops[dtype]

    def device_fp8_tflops(self) -> float | None:
        """This device's fp8 GEMM rate, measured once per run, the first time a case runs fp8
        GEMMs (precision fp8, ``quantised_gemm: fp8``); None on a device without fp8 tensor
        cores (a CPU), recorded so."""
        if FP8 not in self.gemm_tflops:
            self.gemm_tflops[FP8] = fp8_gemm_tflops(self.device)
        return self.gemm_tflops[FP8]

    def device_bandwidth(self, dtype: str, threads: int | None) -> float:
        """This device's copy bandwidth (GB/s) in ``dtype``, measured once per run: what the
        roofline's bytes are against."""
        if dtype not in self.copy_gbytes_per_s:
            self.copy_gbytes_per_s[dtype] = copy_bandwidth(self.device, DTYPES[dtype],
                                                           threads=threads)
        return self.copy_gbytes_per_s[dtype]

    def model(self, case: Case) -> Transformer:
        sc = case.scenario
        key = json.dumps([sc.model.model_dump(), sc.seed, sc.dtype, sc.precision,
                          sc.expert_precision], sort_keys=True, default=str)
        if key not in self.models:
            self.models.clear()
            self.engines.clear()
            self.flops.clear()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.full_tasks.clear()
            self.shared_checks.clear()
            self.models[key] = self.build_model(case)
        return self.models[key]

    def build_model(self, case: Case) -> Transformer:
        """The case's model: seeded dummy weights, or the checkpoint ``model.weights`` names."""
        sc = case.scenario
        model = build_model(case.model_args(), seed=sc.seed, device=self.device,
                            dtype=DTYPES[sc.dtype])[0]
        weights = sc.weights_path()
        if weights is not None:
            load_weights(model, weights)
        return model

    def inputs(self, case: Case, model: Transformer) -> StepInputs:
        """The step this process runs for ``case``: its whole batch on one rank; a trained
        model reads held-out text, dummy weights seeded tokens."""
        sc, requests = case.scenario, case.requests()
        indices = sc.workload.cache_indices(len(requests), model.args.max_requests, sc.seed)
        if sc.model.weights is None:
            return StepInputs.seeded(requests, model.args.vocab_size, sc.seed, indices)
        return StepInputs.held_out_text(requests, sc.seed, indices)

    def tasks(self, case: Case, model: Transformer) -> tuple[TaskRun, CheckResult]:
        """The case policy's task run, graded prompt by prompt against the full prefill's (run
        once per model and settings). The settings hold the chunk size, so the key does too: the
        reference is the full prefill in the case's own chunks, and agreement measures what the
        policy changes, not what chunking does."""
        sc, t = case.scenario, case.scenario.checks.tasks
        window = model.args.window
        settings = TaskSettings(prompt_lens=tuple(w * window for w in t.windows),
                                distances=tuple(t.distances), prompts=t.prompts,
                                continuation=sc.task_continuation(), seed=sc.seed,
                                chunk_size=t.chunk_size)
        name = sc.model.weights or "seeded"
        kernels = case.engine_config().kernels
        key = json.dumps([dataclasses.asdict(settings), sc.halo_align, repr(kernels)])
        if key not in self.full_tasks:
            self.full_tasks[key] = run_tasks(model, "full", settings, model_name=name,
                                             kernels=kernels)
        full = self.full_tasks[key]
        run = full if sc.policy == "full" else run_tasks(
            model, sc.policy, settings, model_name=name, kernels=kernels, reference=full,
            halo_align=sc.halo_align)
        return run, agreement_check(run.results, must_agree=sc.policy in ("full", "halo"))

    def engine_pair(
        self, model: Transformer, config: EngineConfig, *, agree: bool = False
    ) -> tuple[Engine, Engine]:
        """(reference, replay) engines of ``config`` (``agree``: planning under ``self.agree``).
        Graph engines of other configurations are dropped first: the graph pools of one
        configuration at a time."""
        reference = config.reference(model.args)
        keep = {(reference, agree), (config, agree)}
        stale = [k for k in self.engines if k[0].graph_mode != "eager" and k not in keep]
        for other in stale:
            del self.engines[other]
        if stale and self.device.type == "cuda":
            gc.collect()  # whatever still holds a dropped graph, release its pool before reuse
            torch.cuda.empty_cache()
        for key in keep:
            if key not in self.engines:
                self.engines[key] = Engine(model, key[0], agree=self.agree if agree else None)
        return self.engines[(reference, agree)], self.engines[(config, agree)]

    def engine(self, model: Transformer, config: EngineConfig) -> Engine:
        """The engine a check runs for ``config`` (``equivalence.EngineSource``): a graph mode's
        is the runner's (its graphs captured once for the checks and the timing); an eager one is
        built fresh, since it captures nothing and its caches need not stay resident."""
        if config.graph_mode == "eager":
            return Engine(model, config)
        return self.engine_pair(model, config)[1]

    def run_checks(self, case: Case, model: Transformer, inputs: StepInputs) -> list[CheckResult]:
        return list(self.iter_checks(case, model, inputs))

    def iter_checks(
        self, case: Case, model: Transformer, inputs: StepInputs,
        skip: frozenset[str] | set[str] = frozenset(),
    ) -> Iterator[CheckResult]:
        """E1-E5 one by one, each run when asked for (and not in ``skip``: a prompt case runs
        E1 and E2 on its carried caches instead). E1, E2 and E5 run the engine of the case's
        configuration (its graph mode too) against the oracle; E3 compares its graphs with eager
        at their padded shapes. Before them (with E1 or E2), every row's visible keys and
        selections against the oracle's causal rule (``selection.check_visibility``)."""
        sc, cfg, config = case.scenario, case.scenario.checks, case.engine_config()
        engines = functools.partial(self.engine, model)
        # The batch-invariant mode's E1/E2 build engines of their own: graphs captured in the
        # mode record its row-by-row ops, and the runner's engines are the ones timing replays.
        invariant_engines = None if cfg.batch_invariant else engines
        if cfg.e1.enabled or cfg.e2.enabled:
            # E1's and E2's truths and the oracle share the model's visibility rule: graded
            # apart, first (what every later comparison assumes).
            yield self.shared("visibility", (model, config.kernels, config.capture_sizes,
                                             inputs.requests, inputs.cache_indices,
                                             hash(tuple(map(tuple, inputs.sequences)))),
                              lambda: selection.check_visibility(model, inputs, config))
        if cfg.e1.enabled and "e1" not in skip:
            yield equivalence.check_e1(model, inputs, config, decode_steps=2 * model.args.window,
                                       tol=Allowance(cfg.e1.rtol, cfg.e1.atol),
                                       engines=invariant_engines, invariant=cfg.batch_invariant)
        if cfg.e2.enabled and "e2" not in skip:
            yield equivalence.check_e2(model, inputs, config,
                                       tol=Allowance(cfg.e2.rtol, cfg.e2.atol),
                                       engines=invariant_engines, invariant=cfg.batch_invariant)
        if cfg.e3.enabled:
            yield equivalence.check_e3(model, inputs, config, engines=engines)
        if cfg.e4.enabled:
            tol = Tolerance.for_dtype(DTYPES[sc.dtype], cfg.e4.rtol, cfg.e4.atol)
            yield self.shared("E4", (model, tol, config.kernels, cfg.batch_invariant,
                                     max(r.prompt_len for r in inputs.requests)),
                              lambda: equivalence.check_e4(model, inputs, tol=tol,
                                                           kernels=config.kernels,
                                                           invariant=cfg.batch_invariant))
        if cfg.e5.enabled:
            yield equivalence.check_e5(model, inputs, config, engines=engines)

    def shared(self, check: str, inputs: tuple, run: Callable[[], CheckResult]) -> CheckResult:
        """``check``'s result on ``inputs`` (the model first, by identity), run once per runner
        and model; each case gets its own copy."""
        key = repr((check, id(inputs[0]), *inputs[1:]))
        if key not in self.shared_checks:
            self.shared_checks[key] = run()
        return self.shared_checks[key].model_copy(deep=True)

    def run_case(self, case: Case, *, timing: bool = True) -> CaseResult:
        sc = case.scenario
        result = case_skeleton(case, status="ok")
        try:
            result.kernels = kernel_record(case, self.device)
            model = self.model(case)
            if sc.workload.prompts:
                self.run_prompts(case, model, result, timing=timing)
                return _finished(result)
            inputs = self.inputs(case, model)
            result.batch, result.batch_shape = inputs.describe(), inputs.shape()
            result.checks = self.run_checks(case, model, inputs)
            if sc.checks.approximation.enabled:
                a = sc.checks.approximation
                result.approximation, first_kv = measure(
                    model, inputs, continuation_steps=sc.continuation_steps(),
                    kernels=case.engine_config().kernels, halo_align=sc.halo_align,
                    policy=sc.policy,
                )
                result.checks.append(first_kv)
                result.checks.append(check_bounds(
                    result.approximation, max_logits_abs_error=a.max_logits_abs_error,
                    min_top1_agreement=a.min_top1_agreement,
                    min_greedy_agreement=a.min_greedy_agreement, policy=sc.policy,
                ))
            if sc.checks.tasks.enabled:
                run, agreement = self.tasks(case, model)
                result.tasks = run.results
                result.checks.append(agreement)
            if timing and sc.timing.enabled:
                self.measure(case, model, inputs, result)
        except Exception as err:  # recorded; the sweep goes on
            result.status = "error"
            result.error = f"{type(err).__name__}: {err}".strip()
            result.error += "\n" + "".join(traceback.format_exception(err)[-3:])
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return result
        return _finished(result)

    def prompt(self, case: Case, model: Transformer, entry: PromptEntry) -> ChunkedPrompt:
        """One ``workload.prompts`` entry as its steps: seeded tokens, or held-out text for a
        trained model (as ``inputs`` draws a step's)."""
        sc = case.scenario
        indices = sc.workload.cache_indices(1 + entry.decodes_beside, model.args.max_requests,
                                            sc.seed)
        return ChunkedPrompt.build(entry.length, entry.chunk_size, vocab=model.args.vocab_size,
                                   seed=sc.seed, decodes_beside=entry.decodes_beside,
                                   decode_context=entry.decode_context, cache_indices=indices,
                                   held_out_text=sc.model.weights is not None)

    def run_prompts(self, case: Case, model: Transformer, result: CaseResult, *,
                    timing: bool) -> None:
        """A prompt case: per prompt, E1 at every chunk on carried caches, E2 on a halo run's
        end state, the approximation after the last chunk; E3-E5 on the last chunk's step (its
        context a reference prefill, as a step case's); then both paths timed through every
        chunk and the first decode (``bench.prompts``). The case's own timing stays empty: its
        figures are its prompts'."""
        sc, cfg, config = case.scenario, case.scenario.checks, case.engine_config()
        engines = functools.partial(self.engine, model)
        prompts = [self.prompt(case, model, entry) for entry in sc.workload.prompts]
        result.batch = ", ".join(f"prompt {p.length} in chunks of {p.chunk_size}"
                                 + (f" + {p.decodes_beside} decodes" if p.decodes_beside else "")
                                 for p in prompts)
        result.batch_shape = "chunked prompt"
        halo = dict(halo_align=sc.halo_align, kernels=config.kernels)
        for prompt in prompts:
            name = f"prompt {prompt.length}/{prompt.chunk_size}"
            if cfg.e1.enabled:
                result.checks += prompt_checks.check_prompt_e1(
                    model, prompt, config, tol=Allowance(cfg.e1.rtol, cfg.e1.atol),
                    engines=engines)
            run = None
            if cfg.e2.enabled or sc.checks.approximation.enabled:
                run = prompt_checks.run_chunked(model, prompt, policy=sc.policy, **halo)
            if cfg.e2.enabled:
                halo_run = run if sc.policy == "halo" else prompt_checks.run_chunked(
                    model, prompt, policy="halo", **halo)
                result.checks.append(prompt_checks.check_halo_end_state(
                    halo_run, prompt, tol=Allowance(cfg.e2.rtol, cfg.e2.atol)))
            approximation = None
            if sc.checks.approximation.enabled:
                a = sc.checks.approximation
                approximation, first_kv = prompt_checks.prompt_approximation(
                    run, prompt, policy=sc.policy, halo_align=sc.halo_align,
                    continuation_steps=sc.continuation_steps())
                bounds = check_bounds(
                    approximation, max_logits_abs_error=a.max_logits_abs_error,
                    min_top1_agreement=a.min_top1_agreement,
                    min_greedy_agreement=a.min_greedy_agreement, policy=sc.policy)
                for check in (first_kv, bounds):
                    check.name += f", {name} after its last chunk"
                result.checks += [first_kv, bounds]
            last = prompt.step(prompt.num_chunks - 1)
            result.checks += list(self.iter_checks(case, model, last, skip={"e1", "e2"}))
            timed = None
            if timing and sc.timing.enabled:
                t = sc.timing
                reference, replay = self.engine_pair(model, config)
                timed = time_prompt(reference, replay, prompt, TimingSettings(
                    warmup=t.warmup, iters=t.iters, l2_flush=t.l2_flush, threads=t.threads,
                    breakdown=False))
            record = prompt_result(prompt, timed)
            record.approximation = approximation
            result.prompts.append(record)
            for name, peak in record.peak_memory_bytes.items():  # the case's: its largest prompt
                result.peak_memory_bytes[name] = max(peak, result.peak_memory_bytes.get(name, 0))
        if sc.checks.tasks.enabled:
            run, agreement = self.tasks(case, model)
            result.tasks = run.results
            result.checks.append(agreement)

    def roofline(self, case: Case, model: Transformer, inputs: StepInputs,
                 plans: dict[str, StepPlan], result: CaseResult, peak: float,
                 engines: dict[str, Engine]) -> None:
        """Each path's analytic bytes and roofline time from the plan of its timed step (in the
        model dtype's formats), and the roofline ideal with the speedup's share of it."""
        dtype, threads = case.scenario.dtype, case.scenario.timing.threads
        bandwidth = self.device_bandwidth(dtype, threads)
        formats = WeightFormats.of_dtype(DTYPES[dtype])
        costs = {name: step_costs(model.args, inputs.requests, plans[name].kept_lens,
                                  self.device, engines[name].kernels, formats)
                 for name in ("reference", "replay")}
        result.reference_bytes = sum(c.bytes for c in costs["reference"].values())
        result.replay_bytes = sum(c.bytes for c in costs["replay"].values())
        result.roofline_ms = {name: roofline_ms(c, peak, bandwidth) for name, c in costs.items()}
        result.roofline_ideal_speedup = (result.roofline_ms["reference"]
                                         / result.roofline_ms["replay"])
        result.roofline_efficiency = result.speedup / result.roofline_ideal_speedup

    def mfu_basis(self, case: Case, model: Transformer, inputs: StepInputs,
                  plans: dict[str, StepPlan], flops: dict[str, int],
                  engines: dict[str, Engine], peak: float) -> MfuBasis:
        """Each path's counted FLOPs split by the rate they run at: its fp8 Linears' on fp8
        GEMMs (the analytic model on the timed step's plan, ``flop_model.precision_split``: none
        unless precision fp8 with ``quantised_gemm: fp8``) at the fp8 rate, the rest at the
        dtype's. The fp8 rate is measured only here, when a path runs fp8 GEMMs; on a device
        without one (a CPU) every FLOP is counted at the dtype rate, today's MFU. A graph step's
        padded rows are counted by torch's counter, not the model: their fp8 GEMMs go with the
        dtype's FLOPs (a share of at most the padding, which raises MFU a little)."""
        fp8_gemm = {name: precision_split(model.args, inputs.requests, plans[name].kept_lens,
                                          self.device, engines[name].kernels).fp8
                    for name in engines}
        rate = self.device_fp8_tflops() if any(fp8_gemm.values()) else None
        at_fp8 = {name: fp8_gemm[name] if rate is not None else 0 for name in engines}
        if not any(fp8_gemm.values()):
            note = "no fp8 GEMMs ran: every FLOP at the dtype's GEMM rate"
        elif rate is None:
            note = (f"the fp8 Linears ran fp8 GEMMs, but {self.device.type} has no fp8 GEMM "
                    "rate: every FLOP at the dtype's GEMM rate")
        else:
            note = ("the fp8 Linears' FLOPs (analytic, the timed step's plan) at the fp8 GEMM "
                    "rate, the rest (counted less those) at the dtype's")
        return MfuBasis(dtype=case.scenario.dtype, dtype_tflops=peak, fp8_tflops=rate,
                        fp8_flops=at_fp8,
                        dtype_flops={name: flops[name] - at_fp8[name] for name in engines},
                        fp8_gemm_flops=fp8_gemm, note=note)

    def measure(self, case: Case, model: Transformer, inputs: StepInputs, result: CaseResult):
        """Both paths in the case's graph mode; every figure from the plan of the timed step."""
        config, t = case.engine_config(), case.scenario.timing
        reference, replay = self.engine_pair(model, config, agree=self.agree is not None)
        settings = TimingSettings(warmup=t.warmup, iters=t.iters, l2_flush=t.l2_flush,
                                  threads=t.threads, breakdown=t.breakdown)
        m = measure_paths(reference, replay, inputs, settings, self.flops)
        result.timing = m.timing
        result.peak_memory_bytes = m.peak_memory_bytes
        result.flops = m.flops
        result.ideal_speedup = m.flops["reference"] / max(m.flops["replay"], 1)
        result.speedup = m.timing.reference.median_ms / m.timing.replay.median_ms
        result.efficiency = result.speedup / result.ideal_speedup
        peak = self.device_tflops(case.scenario.dtype, t.threads)
        engines = {"reference": reference, "replay": replay}
        result.mfu_basis = self.mfu_basis(case, model, inputs, m.plans, m.flops, engines, peak)
        basis = result.mfu_basis
        for name, stats in (("reference", m.timing.reference), ("replay", m.timing.replay)):
            result.achieved_tflops[name] = achieved_tflops(m.flops[name], stats.median_ms)
            result.mfu[name] = mfu(basis.fp8_flops[name], basis.dtype_flops[name],
                                   stats.median_ms, peak, basis.fp8_tflops)
        self.roofline(case, model, inputs, m.plans, result, peak, engines)
        plan = m.plans["replay"]
        result.replay_route = plan.reason
        result.replay_capture_sizes = list(config.replay_capture_sizes)
        graphs = replay.graphs
        result.deterministic = {
            "kept_rows": plan.num_kept,
            "flops_reference": m.flops["reference"],
            "flops_replay": m.flops["replay"],
            "graphs_captured": 0 if graphs is None else len(graphs.graphs),
            "graph_segments": 0 if graphs is None else graphs.stats.segments,
            "graph_breaks": 0 if graphs is None else graphs.stats.breaks,
        }
        on_cuda = self.device.type == "cuda"
        if graphs is not None:
            result.deterministic["padded_tokens"] = plan.graph_size or 0
            result.capture_seconds = graphs.stats.seconds
            result.graph_pool_bytes = graphs.stats.pool_bytes if on_cuda else None
        if replay.replay_graphs is not None:
            result.deterministic["replay_graph_rows"] = plan.replay_graph_size or 0
            result.replay_graph_sizes = sorted(replay.replay_graphs.graphs)
            result.replay_capture_seconds = replay.replay_graphs.stats.seconds
            result.replay_graph_pool_bytes = (replay.replay_graphs.stats.pool_bytes if on_cuda
                                              else None)
