"""The scenario file as pydantic models.

Field-local rules (types, ranges, enums, unknown keys) are pydantic's; rules that need the resolved
model (the window W, max_seq_len, max_requests) live in ``Scenario.problems()``, which runs per
case after sweep substitution, because a sweep may change the model and the workload together.
All models are strict: YAML already types its values, so ``"8"`` or ``yes`` for a number is a
mistake to report, not to coerce.
"""

from __future__ import annotations

import copy
import difflib
import random
import typing
from functools import cache
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import torch
from annotated_types import Ge, Le, MinLen
from pydantic import (
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    field_validator,
)
from pydantic_core import ErrorDetails

from swa_bench.checks.tolerance import Tolerance
from swa_bench.engine.config import (
    DEFAULT_EAGER_TRIM_THRESHOLD,
    DEFAULT_GRAPH_MODE,
    DEFAULT_HALO_ALIGN,
    DEFAULT_MAX_CAPTURE_SIZE,
    DEFAULT_POLICY,
    DEFAULT_REPLAY_GRAPHS,
    EngineConfig,
    GraphMode,
    default_replay_capture_sizes,
    kernel_settings_from_environment,
    replay_graphs_gate,
    resolve_kernels,
    trim_threshold_problem,
)
from swa_bench.graphs.capture_sizes import capture_sizes_problem, default_capture_sizes
from swa_bench.kernels.config import KernelSettings, TileConfig
from swa_bench.model.args import MODEL_FIELDS, PRESETS, ModelArgs, build_args
from swa_bench.model.moe import grouped_mm_problems
from swa_bench.model.requests import RequestSpec, prefix_hit_request
from swa_bench.model.weights import WeightsError, check_weights, read_header
from swa_bench.model.weights import resolve as resolve_weights
from swa_bench.parallel.layout import ParallelLayout, layout_problems
from swa_bench.replay.row_selection import Policy
from swa_bench.scenario.errors import Loc

PositiveInt = Annotated[int, Ge(1)]
NonNegativeInt = Annotated[int, Ge(0)]
# Finite: an infinite tolerance or allowance would pass any difference (E1 then reported "inf of
# the allowance"); NaN compares false with everything.
NonNegativeFloat = Annotated[float, Ge(0), AllowInfNan(False)]
Fraction = Annotated[float, Ge(0), Le(1)]
# Names become folder names (reports/<name>-<UTC time>), which file systems cap at 255 bytes.
ScenarioName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                                                max_length=100)]
Seed = Annotated[int, Ge(0), Le(2**63 - 1)]  # torch.Generator.manual_seed's range
MAX_CASES = 1000
# The most --max-cases may raise it to: each expanded case holds its resolved scenario (~13 KB),
# so a 10**9-case grid under --max-cases 2000000000 would expand for minutes and gigabytes.
MAX_CASES_LIMIT = 100_000

Device = Literal["auto", "cpu", "cuda"]
Dtype = Literal["float32", "bfloat16", "float16"]
CheckId = Literal["e1", "e2", "e3", "e4", "e5"]


Problem = tuple[Loc, str]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    # Keys that are rejected with a reason rather than as merely unknown.
    rejected_keys: ClassVar[dict[str, str]] = {}


class ModelSpec(_Strict):
    """A preset plus ModelArgs overrides; the override rules need ModelArgs, so they are checked
    in ``Scenario.problems()`` where each error can name ``model.overrides.<field>``."""

    preset: str | None = "tiny"
    overrides: dict[str, Any] = Field(default_factory=dict)
    # Trained weights: a shipped checkpoint's name (``v41-mini``) or a safetensors file, relative
    # to the scenario's folder. None: dummy weights from the scenario's seed.
    weights: Annotated[str, MinLen(1)] | None = None

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, preset: str | None) -> str | None:
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)} "
                             "or null (ModelArgs defaults)")
        return preset

    def args(self) -> ModelArgs:
        return build_args(self.preset, self.overrides)


class RequestEntry(_Strict):
    """One explicit request, added ``repeat`` times. What it asks of the engine (README "Engine
    gates"): ``prompt_logprobs``, ``context_logits`` (logits at every row: kept whole),
    ``spec_decode_tokens`` (a decode row's speculative verify rows: kept whole), ``prefix_hit``
    (``cached_len`` is a prefix-cache hit, served as vLLM does: ``prefix_hit_request``)."""

    prompt_len: PositiveInt
    cached_len: NonNegativeInt = 0
    chunk_size: PositiveInt | None = None
    decode: bool = False
    prompt_logprobs: bool = False
    context_logits: bool = False
    spec_decode_tokens: NonNegativeInt = 0
    prefix_hit: bool = False
    repeat: PositiveInt = 1

    def spec(self, window: int) -> RequestSpec:
        """The request the engine runs; a prefix hit as vLLM serves it under the model's
        window (the step's rows change: decided once, there)."""
        if self.prefix_hit:
            return prefix_hit_request(self.prompt_len, self.cached_len, window,
                                      chunk_size=self.chunk_size,
                                      prompt_logprobs=self.prompt_logprobs,
                                      context_logits=self.context_logits)
        return RequestSpec(prompt_len=self.prompt_len, cached_len=self.cached_len,
                           chunk_size=self.chunk_size, decode=self.decode,
                           prompt_logprobs=self.prompt_logprobs,
                           context_logits=self.context_logits,
                           spec_decode_tokens=self.spec_decode_tokens)

    def specs(self, window: int) -> list[RequestSpec]:
        return [self.spec(window)] * self.repeat

    def served_hit(self, window: int) -> str | None:
        """How the engine served this entry's prefix hit (what ``spec`` decided), for the
        case's results; None without one."""
        if not self.prefix_hit:
            return None
        spec = self.spec(window)
        if spec.recomputed_rows:
            return (f"hit {self.cached_len} of {self.prompt_len}: recomputes "
                    f"[{spec.cached_len}, {spec.filled_len})")
        return f"hit {self.cached_len} of {self.prompt_len}: not adopted (<= W={window}), from 0"

    def problems(self, args: ModelArgs) -> list[Problem]:
        if self.spec_decode_tokens and not self.decode:
            return [(("spec_decode_tokens",), "verify rows follow a decode row: set decode: "
                                              "true")]
        if self.spec_decode_tokens + 1 > args.window:
            return [(("spec_decode_tokens",), f"a decode row and {self.spec_decode_tokens} "
                                              f"verify rows exceed the model window "
                                              f"W={args.window} (SPEC 2: q <= W)")]
        if self.prefix_hit and (self.decode or self.cached_len == 0):
            return [(("prefix_hit",), "a prefix hit is a prefill's cached_len > 0 (the hit's "
                                      "length)")]
        if not self.decode and self.cached_len >= self.prompt_len:
            return [(("cached_len",), f"a prefill's cached_len must be below prompt_len="
                                      f"{self.prompt_len}, got {self.cached_len}")]
        if (self.prefix_hit and self.cached_len > args.window and self.chunk_size is not None
                and self.chunk_size <= args.window):
            return [(("chunk_size",), f"a prefix hit recomputes W={args.window} rows first: "
                                      f"the chunk must hold them and more, got "
                                      f"{self.chunk_size}")]
        seq_len = self.spec(args.window).seq_len
        if seq_len > args.max_seq_len:
            return [(("prompt_len",), f"the request reaches length {seq_len}, above the model's "
                                      f"max_seq_len={args.max_seq_len}")]
        return []


class RequestGenerator(_Strict):
    """``prefills`` prefills of ``prompt_len`` tokens plus ``decodes`` decode rows, each after
    ``decode_context`` tokens of context (null: ``prompt_len``)."""

    prefills: NonNegativeInt = 1
    prompt_len: PositiveInt
    cached_len: NonNegativeInt = 0
    chunk_size: PositiveInt | None = None
    decodes: NonNegativeInt = 0
    decode_context: PositiveInt | None = None

    def specs(self, window: int) -> list[RequestSpec]:
        """``window`` unused: generated requests ask for no gate (the entries' signature)."""
        del window
        out: list[RequestSpec] = []
        if self.prefills:
            out += [RequestSpec(prompt_len=self.prompt_len, cached_len=self.cached_len,
                                chunk_size=self.chunk_size)] * self.prefills
        if self.decodes:
            context = self.decode_context or self.prompt_len
            out += [RequestSpec(prompt_len=context, decode=True)] * self.decodes
        return out

    def problems(self, args: ModelArgs) -> list[Problem]:
        out: list[Problem] = []
        if self.prefills and self.cached_len >= self.prompt_len:
            out.append((("cached_len",), f"a prefill's cached_len must be below prompt_len="
                                         f"{self.prompt_len}, got {self.cached_len}"))
        elif self.prefills and self.prompt_len > args.max_seq_len:
            out.append((("prompt_len",), f"{self.prompt_len} is above the model's max_seq_len="
                                         f"{args.max_seq_len}"))
        context = self.decode_context or self.prompt_len
        if self.decodes and context + 1 > args.max_seq_len:
            field = "decode_context" if self.decode_context else "prompt_len"
            out.append(((field,), f"a decode row after {context} tokens reaches length "
                                  f"{context + 1}, above the model's max_seq_len="
                                  f"{args.max_seq_len}"))
        return out


class PromptEntry(_Strict):
    """One whole prompt of ``length`` tokens prefilled in chunks of ``chunk_size`` (the last one
    shorter), each chunk batched with ``decodes_beside`` decode rows of other requests, as a
    scheduler batches them; those start after ``decode_context`` tokens (null: ``length``) and
    advance one token a step (``swa_bench.engine.chunked_prompt``)."""

    length: PositiveInt
    chunk_size: PositiveInt
    decodes_beside: NonNegativeInt = 0
    decode_context: PositiveInt | None = None

    @property
    def num_chunks(self) -> int:
        return -(-self.length // self.chunk_size)

    def problems(self, args: ModelArgs, reserve: int) -> list[Problem]:
        """The prompt, its first decode and ``reserve`` decode steps of the checks fit the
        model; so do the decode rows beside it, one token further each step."""
        if self.length + 1 + reserve > args.max_seq_len:
            return [(("length",), f"{self.length} tokens, the first decode and {reserve} decode "
                                  f"steps of the checks exceed max_seq_len={args.max_seq_len}")]
        context = self.decode_context or self.length
        longest = context + self.num_chunks + 1 + reserve
        if self.decodes_beside and longest > args.max_seq_len:
            field = "decode_context" if self.decode_context else "length"
            return [((field,), f"the decode rows beside the prompt reach length {longest} "
                               f"({context} + {self.num_chunks} chunk steps + the first decode "
                               f"+ {reserve} check steps), above max_seq_len={args.max_seq_len}")]
        if 1 + self.decodes_beside > args.max_requests:
            return [(("decodes_beside",), f"the prompt and {self.decodes_beside} decode rows "
                                          f"exceed the model's max_requests={args.max_requests}")]
        return []


class Workload(_Strict):
    """The requests of one step (explicit ones first, then generated ones), or whole prompts
    (``prompts``): a case is one of the two. A prompt case runs each prompt's chunks step after
    step with the caches carried, from empty caches per prompt."""

    requests: list[RequestEntry] = Field(default_factory=list)
    generators: list[RequestGenerator] = Field(default_factory=list)
    prompts: list[PromptEntry] = Field(default_factory=list)
    # Cache slot of each request: its batch position, the highest slots in reverse, a seeded
    # permutation of every slot, or explicit indices (a serving engine's slots are not batch order).
    cache_order: Literal["sequential", "reversed", "shuffled"] | list[NonNegativeInt] = "sequential"

    def specs(self, window: int) -> list[RequestSpec]:
        """The step's requests as the engine runs them under the model's ``window``."""
        out = [spec for entry in self.requests for spec in entry.specs(window)]
        return out + [spec for gen in self.generators for spec in gen.specs(window)]

    def cache_indices(self, num: int, max_requests: int, seed: int) -> list[int] | None:
        """Each request's cache index; None for batch order."""
        if isinstance(self.cache_order, list):
            return list(self.cache_order)
        if self.cache_order == "reversed":
            return [max_requests - 1 - i for i in range(num)]
        if self.cache_order == "shuffled":
            return random.Random(seed).sample(range(max_requests), num)
        return None


class ToleranceCheck(_Strict):
    """A check compared up to rounding; null tolerances take the dtype's default."""

    enabled: bool = True
    rtol: NonNegativeFloat | None = None
    atol: NonNegativeFloat | None = None


class BitwiseCheck(_Strict):
    """A check that is bitwise by definition (E3, E5), so it takes no tolerance."""

    rejected_keys: ClassVar[dict[str, str]] = {
        key: "this check is always bitwise; rtol/atol are not accepted" for key in ("rtol", "atol")
    }
    enabled: bool = True


class ApproximationCheck(_Strict):
    """Bounded vs full prefill, measured; pass/fail only against the bounds that are set."""

    enabled: bool = False
    continuation_steps: PositiveInt | None = None
    max_logits_abs_error: NonNegativeFloat | None = None
    min_top1_agreement: Fraction | None = None
    min_greedy_agreement: Fraction | None = None


class TasksCheck(_Strict):
    """Task accuracy under the case's policy (``swa_bench.checks.tasks``): recall with the fact
    ``distances`` tokens back and copying inside the window, on prompts of ``windows`` x W
    tokens, ``prompts`` per cell, and the held-out text loss over ``continuation`` decode steps
    (null: W). Halo and full must give the full prefill's answer on every prompt.
    ``chunk_size``: every prompt prefilled in chunks of that many tokens, the caches carried
    (null: one prefill step), graded against the full prefill in the same chunks. Every policy
    plans chunks of any size (bounded keeps all of a chunk of W rows or fewer; E4 checks chunks
    of W - 1, W and W + 1 against one prefill); a size not below the longest prompt would chunk
    nothing while the results said chunked, and is refused."""

    enabled: bool = False
    windows: Annotated[list[PositiveInt], MinLen(1)] = Field(
        default_factory=lambda: [1, 2, 4, 8, 16])
    distances: Annotated[list[Annotated[int, Ge(4)]], MinLen(1)] = Field(
        default_factory=lambda: [8, 32, 128, 240])
    prompts: Annotated[int, Ge(1), Le(4096)] = 8
    continuation: PositiveInt | None = None
    chunk_size: PositiveInt | None = None


class Checks(_Strict):
    e1: ToleranceCheck = Field(default_factory=ToleranceCheck)
    e2: ToleranceCheck = Field(default_factory=ToleranceCheck)
    e3: BitwiseCheck = Field(default_factory=BitwiseCheck)
    e4: ToleranceCheck = Field(default_factory=ToleranceCheck)
    e5: BitwiseCheck = Field(default_factory=BitwiseCheck)
    approximation: ApproximationCheck = Field(default_factory=ApproximationCheck)
    tasks: TasksCheck = Field(default_factory=TasksCheck)
    # E1 and E2 in the batch-invariant mode (kernels/batch_invariant.py): every forward computes
    # a row with the same bits in any batch, so their full-batch halves compare bitwise and a
    # top-k selection that differs fails. CPU with the PyTorch kernels, or CUDA with the Triton
    # kernels (cuBLAS and torch's reductions replaced by fixed-tile ones); timing keeps the
    # fast kernels.
    batch_invariant: bool = False


class Timing(_Strict):
    """``threads``: CPU threads of the timed loop; null takes OMP_NUM_THREADS, else 1 (one thread
    gives repeatable figures on a shared machine; more threads spin-wait against other jobs)."""

    enabled: bool = True
    warmup: Annotated[int, Ge(0), Le(100_000)] = 2
    iters: Annotated[int, Ge(1), Le(1_000_000)] = 10
    l2_flush: bool = False
    threads: Annotated[int, Ge(1), Le(4096)] | None = None
    breakdown: bool = True


AxisValues = Annotated[list[Any], MinLen(1)]


class KernelsSpec(_Strict):
    """Which kernels the case runs (``swa_bench.kernels.KernelSettings``): ``backend`` auto (Triton
    on CUDA, PyTorch elsewhere), torch or triton; ``tile`` the attention kernel's
    ``"block_n,block_dv,num_warps,num_stages"``; ``launch`` direct or triton (Triton's own call
    path); ``quantised_gemm`` bf16 (GEMMs of the stored values) or fp8 (the fp8 tensor-core
    kernel for precision fp8's fp8 Linears; triton backend). An omitted key takes the
    environment's (``SWA_BENCH_KERNELS``, ``SWA_BENCH_MQA_TILE``, ``SWA_BENCH_TRITON_LAUNCH``,
    ``SWA_BENCH_QUANTISED_GEMM``), else auto, the measured tiles, direct, bf16."""

    backend: Literal["auto", "torch", "triton"] | None = None
    tile: str | None = None
    launch: Literal["direct", "triton"] | None = None
    quantised_gemm: Literal["bf16", "fp8"] | None = None

    @field_validator("tile")
    @classmethod
    def _tile(cls, tile: str | None) -> str | None:
        if tile is not None:
            TileConfig.parse(tile, name="")
        return tile

    def settings(self, default: KernelSettings) -> KernelSettings:
        """These settings, each omitted one taken from ``default``."""
        return KernelSettings(self.backend or default.backend,
                              TileConfig.parse(self.tile) if self.tile else default.tile,
                              self.launch or default.launch,
                              self.quantised_gemm or default.quantised_gemm)


class Sweep(_Strict):
    """``grid``: the cartesian product of its axes. ``zip``: groups whose lists move together,
    each group crossed with the grid. Keys are dotted paths into the scenario."""

    grid: dict[str, AxisValues] = Field(default_factory=dict)
    zip: list[Annotated[dict[str, AxisValues], MinLen(1)]] = Field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.grid and not self.zip


class EngineGates(_Strict):
    """The engine-level replay gates (``EngineConfig``; README "Engine gates"): KV block reuse
    (TensorRT-LLM: no replay), LoRA and prompt embeddings (vLLM: no replay graphs; ATOM's
    ``tail`` replays text prefills only). Applied whatever the policy; each case records them."""

    kv_block_reuse: bool = False
    lora: bool = False
    prompt_embeds: bool = False


class Parallel(_Strict):
    """The parallel layout (``swa_bench.parallel``): DP replicas of a TP group whose experts are
    split over ``ep`` ranks (1 or tp). A layout of more than one process runs under torchrun."""

    dp: PositiveInt = 1
    tp: PositiveInt = 1
    ep: PositiveInt = 1

    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.dp, self.tp, self.ep)


class Scenario(_Strict):
    """One scenario file; after ``expand_cases`` each case's scenario has an empty sweep."""

    name: ScenarioName
    description: str = ""
    device: Device = "auto"
    dtype: Dtype = "float32"
    # The numerics (model/precision.py): bf16, or the release's fp8 (fp8 dense, fp4 experts,
    # fp8/fp4 KV); under fp8 the routed experts as the reference runs them (w4a8) or as Hopper
    # engines do (w4a16). ModelArgs fields, set here so a sweep can vary them.
    precision: Literal["bf16", "fp8"] = "bf16"
    expert_precision: Literal["w4a8", "w4a16"] = "w4a8"
    seed: Seed = 0
    model: ModelSpec = Field(default_factory=ModelSpec)
    workload: Workload
    # The engine's settings; what is left out takes ``EngineConfig.for_model``'s default.
    policy: Policy = DEFAULT_POLICY
    halo_align: PositiveInt = DEFAULT_HALO_ALIGN
    graph_mode: GraphMode = DEFAULT_GRAPH_MODE
    trim_threshold: PositiveInt | None = None
    eager_trim_threshold: NonNegativeInt = DEFAULT_EAGER_TRIM_THRESHOLD
    capture_sizes: list[PositiveInt] | None = None
    max_capture_size: Annotated[int, Ge(1), Le(1 << 20)] = DEFAULT_MAX_CAPTURE_SIZE
    # PIECEWISE replay batches in graphs of their own; null sizes: vLLM's rule (issue 34).
    replay_graphs: bool = DEFAULT_REPLAY_GRAPHS
    replay_capture_sizes: list[PositiveInt] | None = None
    kernels: KernelsSpec = Field(default_factory=KernelsSpec)
    engine: EngineGates = Field(default_factory=EngineGates)
    sweep: Sweep = Field(default_factory=Sweep)
    checks: Checks = Field(default_factory=Checks)
    timing: Timing = Field(default_factory=Timing)
    parallel: Parallel = Field(default_factory=Parallel)

    _source_path: Path | None = PrivateAttr(default=None)
    _source_text: str = PrivateAttr(default="")
    _max_cases: int = PrivateAttr(default=MAX_CASES)

    @field_validator("capture_sizes", "replay_capture_sizes")
    @classmethod
    def _increasing(cls, sizes: list[int] | None) -> list[int] | None:
        if sizes is not None and (problem := capture_sizes_problem(sizes)):
            raise ValueError(problem)
        return sizes

    def bind_source(self, path: str | Path | None, text: str,
                    max_cases: int = MAX_CASES) -> Scenario:
        """Where this scenario came from and its sweep cap, set once by whoever read it (the
        loader; the sweep for each case it derives); returns ``self``."""
        self._source_path = Path(path) if path is not None else None
        self._source_text, self._max_cases = text, max_cases
        return self

    @property
    def source_path(self) -> Path | None:
        """The file this scenario was loaded from; errors name it."""
        return self._source_path

    @property
    def source_text(self) -> str:
        """The raw file text: hashed into results and used to find error lines."""
        return self._source_text

    @property
    def max_cases(self) -> int:
        """The most cases the sweep may expand to (``--max-cases``)."""
        return self._max_cases

    def model_args(self) -> ModelArgs:
        return self.model.args().replace(precision=self.precision,
                                         expert_precision=self.expert_precision)

    def requests(self) -> list[RequestSpec]:
        return self.workload.specs(self.model_args().window)

    def prefix_hits(self) -> list[str]:
        """How the engine served each prefix hit of the workload (``RequestEntry.served_hit``)."""
        window = self.model_args().window
        return [hit for entry in self.workload.requests
                if (hit := entry.served_hit(window)) is not None]

    def kernel_settings(self) -> KernelSettings:
        """The ``kernels:`` section over the environment's default, read here (a case resolves
        it once: ``Case.engine_config``)."""
        return self.kernels.settings(kernel_settings_from_environment())

    def engine_config(self) -> EngineConfig:
        """The complete engine configuration of this (expanded, valid) scenario: its replay
        path; the reference is this with policy full (``EngineConfig.reference``)."""
        return EngineConfig.for_model(
            self.model_args(), policy=self.policy, graph_mode=self.graph_mode,
            trim_threshold=self.trim_threshold, eager_trim_threshold=self.eager_trim_threshold,
            capture_sizes=self.capture_sizes, max_capture_size=self.max_capture_size,
            halo_align=self.halo_align, kernels=self.kernel_settings(),
            replay_graphs=self.replay_graphs, replay_capture_sizes=self.replay_capture_sizes,
            kv_block_reuse=self.engine.kv_block_reuse, lora=self.engine.lora,
            prompt_embeds=self.engine.prompt_embeds,
        )

    def continuation_steps(self) -> int:
        """K for greedy-continuation agreement: null means 2W (the ring slides out after W)."""
        steps = self.checks.approximation.continuation_steps
        return steps if steps is not None else 2 * self.model_args().window

    def tolerance(self, check: CheckId) -> tuple[float, float]:
        """(rtol, atol) for a check: (0, 0) when bitwise, the dtype default where unset."""
        spec = getattr(self.checks, check)
        if isinstance(spec, BitwiseCheck):
            return 0.0, 0.0
        tol = Tolerance.for_dtype(self.dtype, spec.rtol, spec.atol)
        return tol.rtol, tol.atol

    def problems(self) -> list[Problem]:
        """Every rule that needs the resolved model, as (location, message); empty when valid."""
        model_problems = (_model_problems(self.model) or self._precision_problems()
                          or self._weights_problems())
        if model_problems:
            return model_problems
        args = self.model_args()
        window = args.window
        out: list[Problem] = self._kernel_problems(args) + self._tasks_problems(args)
        if self.trim_threshold is not None and (
                problem := trim_threshold_problem(self.trim_threshold, window)):
            out.append((("trim_threshold",), problem))
        no_graphs = replay_graphs_gate(self.engine.lora, self.engine.prompt_embeds)
        if no_graphs and self.replay_capture_sizes is not None:
            out.append((("replay_capture_sizes",), f"{no_graphs}: drop it, or engine.lora and "
                                                   "engine.prompt_embeds"))
        elif self.graph_mode == "piecewise" and self.replay_graphs and not no_graphs:
            capture = self.capture_sizes or default_capture_sizes(self.max_capture_size)
            try:
                default_replay_capture_sizes(args, capture, self.replay_capture_sizes)
            except ValueError as e:  # sizes beyond what a step can hold
                out.append((("replay_capture_sizes",), str(e)))
        if self.checks.batch_invariant:
            cpu = self.device_type() == "cpu"
            if cpu and self.kernels.backend == "triton":
                out.append((("checks", "batch_invariant"),
                            "runs on CPU with the PyTorch kernels (kernels.backend torch or "
                            "auto), not Triton's interpreter"))
            elif not cpu and self.kernels.backend == "torch":
                out.append((("checks", "batch_invariant"),
                            "runs on CUDA with the Triton kernels (kernels.backend triton or "
                            "auto), not the PyTorch path"))
        steps = self.checks.approximation.continuation_steps
        if steps is not None and steps < window:
            out.append((("checks", "approximation", "continuation_steps"),
                        f"must be >= the model window W={window} (the approximate ring slides "
                        f"out only after W steps), got {steps}"))
        if self.workload.prompts:
            return out + self._prompt_problems(args)
        for kind, entries in (("requests", self.workload.requests),
                              ("generators", self.workload.generators)):
            for i, entry in enumerate(entries):
                out += [(("workload", kind, i, *loc), msg) for loc, msg in entry.problems(args)]
        total = (sum(entry.repeat for entry in self.workload.requests)
                 + sum(gen.prefills + gen.decodes for gen in self.workload.generators))
        if total == 0:
            out.append((("workload",), "needs at least one request (requests, generators "
                                       "or prompts)"))
        elif total > args.max_requests:
            out.append((("workload",), f"{total} requests exceed the model's max_requests="
                                       f"{args.max_requests}"))
        order = self.workload.cache_order
        if isinstance(order, list) and (len(order) != total or len(set(order)) != len(order)
                                        or any(i >= args.max_requests for i in order)):
            out.append((("workload", "cache_order"), f"needs {total} distinct indices below "
                                                     f"max_requests={args.max_requests}"))
        out += [(("parallel", f), m) for f, m in layout_problems(self.parallel.layout(), args)]
        if 0 < total < self.parallel.dp:
            out.append((("parallel", "dp"), f"{self.parallel.dp} ranks need at least as many "
                                             f"requests (they are dealt round-robin), got {total}"))
        if not out:  # the entries' own rules hold, so they build their requests
            out += self._decode_reserve_problems(args)
        return out

    def _precision_problems(self) -> list[Problem]:
        """Widths the precision's quantisation groups do not divide, blamed on ``precision``."""
        probe = copy.copy(self.model.args())
        probe.precision, probe.expert_precision = self.precision, self.expert_precision
        return [(("precision",), f"{self.precision} cannot run this model: {field} {message}")
                for field, message in probe.precision_problems()]

    def device_type(self) -> str:
        """Where the cases run: ``auto`` takes the GPU when one is visible (the one rule;
        ``run.cases.resolve_device`` refuses ``cuda`` without one)."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def _kernel_problems(self, args: ModelArgs) -> list[Problem]:
        """What the kernels cannot run here: a triton backend without CUDA or Triton's
        interpreter, widths the experts' grouped GEMM cannot take. Both would fail every case."""
        out: list[Problem] = []
        for field, message in grouped_mm_problems(args, self.device_type(),
                                                  getattr(torch, self.dtype)):
            where = "overrides" if field in self.model.overrides else "preset"
            out.append((("model", where, field) if where == "overrides" else ("model", where),
                        message if where == "overrides" else f"{field} {message}"))
        try:
            settings = self.kernel_settings()
        except ValueError:  # a malformed SWA_BENCH_* default: each entry point refuses it first
            return out
        try:
            resolve_kernels(settings, self.device_type())
        except ValueError as err:
            reason = str(err).removeprefix("kernels: ")
            if self.kernels.backend is None:  # the backend came from the environment
                reason = reason.replace("backend triton", "backend triton (SWA_BENCH_KERNELS)", 1)
            out.append((("kernels", "backend"), reason))
        return out

    def weights_path(self) -> Path | None:
        if self.model.weights is None:
            return None
        base = self.source_path.parent if self.source_path is not None else None
        return resolve_weights(self.model.weights, base)

    def _weights_problems(self) -> list[Problem]:
        """The weights file must exist and fit the model exactly."""
        path = self.weights_path()
        if path is None:
            return []
        try:
            check_weights(self.model_args(), read_header(path))
        except WeightsError as err:
            return [(("model", "weights"), str(err))]
        return []

    def task_continuation(self) -> int:
        steps = self.checks.tasks.continuation
        return steps if steps is not None else self.model_args().window

    def _tasks_problems(self, args: ModelArgs) -> list[Problem]:
        tasks = self.checks.tasks
        if not tasks.enabled:
            return []
        longest = max(tasks.windows) * args.window + self.task_continuation()
        if longest > args.max_seq_len:
            return [(("checks", "tasks", "windows"),
                     f"{max(tasks.windows)} windows of {args.window} plus "
                     f"{self.task_continuation()} decode steps exceed "
                     f"max_seq_len={args.max_seq_len}")]
        prompt_len = max(tasks.windows) * args.window
        if tasks.chunk_size is not None and tasks.chunk_size >= prompt_len:
            # Every prompt would run in one step, and results labelled chunked would be the
            # whole-prompt figures.
            return [(("checks", "tasks", "chunk_size"),
                     f"{tasks.chunk_size} is not below the longest task prompt "
                     f"({max(tasks.windows)} windows of {args.window} = {prompt_len} tokens): "
                     "every prompt would be one chunk; use null for whole prompts")]
        return []

    def _prompt_problems(self, args: ModelArgs) -> list[Problem]:
        """A prompt case: prompts alone in the workload, on one process, each fitting the
        model with the decode steps the checks run after it."""
        if self.workload.requests or self.workload.generators:
            return [(("workload", "prompts"), "a case is one step (requests, generators) or "
                                              "whole prompts, not both: move them to two "
                                              "scenarios")]
        if self.parallel.layout().world_size > 1:
            return [(("workload", "prompts"), "whole prompts run on one process; set "
                                              "parallel dp = tp = 1")]
        reserve = self._decode_reserve(args)
        out: list[Problem] = []
        for i, prompt in enumerate(self.workload.prompts):
            out += [(("workload", "prompts", i, *loc), msg)
                    for loc, msg in prompt.problems(args, reserve)]
            rows = 1 + prompt.decodes_beside
            order = self.workload.cache_order
            if isinstance(order, list) and (len(order) != rows or len(set(order)) != rows
                                            or any(j >= args.max_requests for j in order)):
                out.append((("workload", "cache_order"),
                            f"needs {rows} distinct indices below max_requests="
                            f"{args.max_requests} (prompt {i} and its decode rows)"))
        return out

    def _decode_reserve(self, args: ModelArgs) -> int:
        """E1 and the continuation decode 2W (resp. K) tokens after each request's step."""
        reserve = 2 * args.window if self.checks.e1.enabled else 0
        if self.checks.approximation.enabled:
            reserve = max(reserve, self.continuation_steps())
        return reserve

    def _decode_reserve_problems(self, args: ModelArgs) -> list[Problem]:
        """E1 and the continuation decode 2W (resp. K) tokens after each request's step."""
        reserve = self._decode_reserve(args)
        if not reserve:
            return []
        out: list[Problem] = []
        for kind, entries in (("requests", self.workload.requests),
                              ("generators", self.workload.generators)):
            for i, entry in enumerate(entries):
                longest = max((r.seq_len for r in entry.specs(args.window)), default=0)
                if longest + reserve > args.max_seq_len:
                    out.append((("workload", kind, i, "prompt_len"),
                                f"reaches length {longest}; the checks decode {reserve} more "
                                f"tokens, above max_seq_len={args.max_seq_len}"))
        return out


SCENARIO_LEVEL_FIELDS = ("precision", "expert_precision")  # ModelArgs fields set by the scenario


@cache
def _override_adapter(field: str) -> TypeAdapter:
    return TypeAdapter(typing.get_type_hints(ModelArgs)[field])


def _model_problems(spec: ModelSpec) -> list[Problem]:
    """Override keys must be ModelArgs fields of the right type, and the result must build."""
    out: list[Problem] = []
    for key, value in spec.overrides.items():
        loc: Loc = ("model", "overrides", key)
        if key in SCENARIO_LEVEL_FIELDS:
            out.append((loc, f"set {key} at the scenario's top level (`{key}:`), not as a "
                             "model override"))
            continue
        if key not in MODEL_FIELDS:
            close = difflib.get_close_matches(key, sorted(MODEL_FIELDS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            out.append((loc, f"unknown model field{hint}"))
            continue
        try:
            _override_adapter(key).validate_python(value, strict=True)
        except ValidationError as err:
            out.append((loc, describe_error(err.errors()[0])[1]))
    if out:
        return out
    args = copy.copy(PRESETS[spec.preset] if spec.preset else ModelArgs())
    for key, value in spec.overrides.items():
        setattr(args, key, value)
    return [(("model", "overrides", field), message) for field, message in args.problems()]


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _model_at(loc: Loc) -> type[_Strict] | None:
    """The model class that holds the last key of ``loc`` (to list its allowed keys)."""
    cls: type[_Strict] | None = Scenario
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = cls.model_fields.get(part) if cls else None
        if field is None:
            return None
        cls = _inner_model(field.annotation)
    return cls


def _inner_model(annotation: Any) -> type[_Strict] | None:
    if isinstance(annotation, type) and issubclass(annotation, _Strict):
        return annotation
    for arg in typing.get_args(annotation):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


_TYPE_NAMES = {
    "int_type": "an integer", "int_from_float": "an integer", "int_parsing": "an integer",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "bool_type": "true or false",
    "string_type": "a string", "list_type": "a list", "dict_type": "a mapping",
    "model_type": "a mapping", "model_attributes_type": "a mapping", "none_required": "null",
}
_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=",
           "less_than": "<"}


def describe_error(error: ErrorDetails) -> Problem:
    """One pydantic error as (location, short message)."""
    loc: Loc = tuple(error["loc"])
    kind, ctx, value = error["type"], error.get("ctx", {}), error.get("input")
    if kind == "missing":
        return loc, "required"
    if kind == "extra_forbidden":
        owner = _model_at(loc)
        key = loc[-1] if loc else ""
        if owner is not None and key in owner.rejected_keys:
            return loc, owner.rejected_keys[key]
        allowed = f"; expected one of: {', '.join(owner.model_fields)}" if owner else ""
        return loc, f"unknown key{allowed}"
    if kind in _TYPE_NAMES:
        return loc, f"must be {_TYPE_NAMES[kind]}, got {_show(value)}"
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        return loc, f"must be {_BOUNDS[kind]} {bound}, got {_show(value)}"
    if kind == "literal_error":
        return loc, f"must be one of {ctx['expected']}, got {_show(value)}"
    if kind == "too_short":
        return loc, "must not be empty"
    if kind == "string_too_long":
        return loc, f"must be at most {ctx['max_length']} characters, got {len(value)}"
    if kind == "string_pattern_mismatch":
        return loc, f"must match {ctx['pattern']}, got {_show(value)}"
    if kind == "value_error":
        return loc, str(ctx.get("error", error["msg"]))
    return loc, f"{error['msg']}, got {_show(value)}"
