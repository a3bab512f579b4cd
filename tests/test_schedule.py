"""Overlapped and exposed collectives of a scheduled module (`zerojax.inspect.schedule`), on HLO written
out by hand in the two forms compilers print: XLA's async pairs (`all-gather-start` /
`all-gather-done`, as GPU programs have them) and the TPU compiler's `async-collective-start.N`
/ `-done.N` fusions with its fused 'all-reduce-scatter'. Sizes: f32[8,8] = 256 bytes, 8 devices,
so an all-gather or reduce-scatter sends 7/8 of its buffer and an all-reduce 2 x 7/8."""

import pytest

from zerojax.inspect.schedule import launches, overlap_bytes, scheduled_collectives

GROUP = "replica_groups={{0,1,2,3,4,5,6,7}}"
XLA = f"""HloModule m, is_scheduled=true

%mm (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {{
  %p0 = f32[8,8]{{1,0}} parameter(0)
  %p1 = f32[8,8]{{1,0}} parameter(1)
  ROOT %dot.1 = f32[8,8]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

%body (p: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {{
  %p = (s32[], f32[8,8]{{1,0}}) parameter(0)
  %x = f32[8,8]{{1,0}} get-tuple-element(%p), index=1
  %ag-start = (f32[1,8]{{1,0}}, f32[8,8]{{1,0}}) all-gather-start(%x), {GROUP}, dimensions={{0}}
  %ag-start.1 = (f32[1,8]{{1,0}}, f32[8,8]{{1,0}}) all-gather-start(%x), {GROUP}, dimensions={{0}}
  %fusion.2 = f32[8,8]{{1,0}} fusion(%x, %x), kind=kOutput, calls=%mm
  %ag-done.1 = f32[8,8]{{1,0}} all-gather-done(%ag-start.1)
  %ag-done = f32[8,8]{{1,0}} all-gather-done(%ag-start)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8,8]{{1,0}}) tuple(%i, %ag-done)
}}

%cond (p: (s32[], f32[8,8])) -> pred[] {{
  %p = (s32[], f32[8,8]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}}

ENTRY %main (a: f32[8,8]) -> f32[8,8] {{
  %a = f32[8,8]{{1,0}} parameter(0)
  %ar-start = f32[8,8]{{1,0}} all-reduce-start(%a), {GROUP}, to_apply=%add
  %ar-done = f32[8,8]{{1,0}} all-reduce-done(%ar-start)
  %rs = f32[1,8]{{1,0}} reduce-scatter(%ar-done), {GROUP}, dimensions={{0}}, to_apply=%add
  %z = s32[] constant(0)
  %t = (s32[], f32[8,8]{{1,0}}) tuple(%z, %a)
  %w = (s32[], f32[8,8]{{1,0}}) while(%t), condition=%cond, body=%body
  ROOT %out = f32[8,8]{{1,0}} get-tuple-element(%w), index=1
}}
"""

TPU = """HloModule t, is_scheduled=true

%fused_computation.1 (param_0: f32[1,8]) -> (f32[1,8], f32[8,8]) {
  %param_0 = f32[1,8]{1,0:T(8,128)} parameter(0)
  %all-gather.1 = f32[8,8]{1,0:T(8,128)} all-gather(%param_0), replica_groups=mesh['data'=8] {'data'}, dimensions={0}
  ROOT %custom-call.1 = (f32[1,8]{1,0}, f32[8,8]{1,0}) custom-call(%all-gather.1), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion.2 (p0: f32[8,8], p1: f32[8,8]) -> (f32[8,8], f32[8,8]) {
  %p0 = f32[8,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  %convolution.1 = f32[8,8]{1,0} convolution(%p0, %p0), dim_labels=bf_io->bf
  %all-gather.2 = f32[8,8]{1,0} all-gather(%p1), replica_groups=mesh['data'=8] {'data'}, dimensions={0}
  ROOT %tuple.1 = (f32[8,8]{1,0}, f32[8,8]{1,0}) tuple(%convolution.1, %all-gather.2)
}

%fused_computation.3 (param_0: f32[8,8]) -> f32[8,8] {
  %param_0 = f32[8,8]{1,0} parameter(0)
  %all-gather.3 = f32[8,8]{1,0} all-gather(%param_0), replica_groups=mesh['data'=8] {'data'}, dimensions={0}
  ROOT %custom-call.3 = f32[8,8]{1,0} custom-call(%all-gather.3), custom_call_target="AsyncCollectiveDone"
}

%all-reduce-scatter.4 (input_0: f32[8,8]) -> f32[1,8] {
  %input_0 = f32[8,8]{1,0} parameter(0)
  %all-reduce.4 = f32[8,8]{1,0} all-reduce(%input_0), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %slice.4 = f32[1,8]{1,0} slice(%all-reduce.4), slice={[0:1], [0:8]}
}

ENTRY %main (a: f32[1,8], b: f32[8,8]) -> f32[1,8] {
  %a = f32[1,8]{1,0} parameter(0)
  %b = f32[8,8]{1,0} parameter(1)
  %async-collective-start.1 = (f32[1,8]{1,0}, f32[8,8]{1,0}) fusion(%a), kind=kCustom, calls=%fused_computation.1
  %gte = f32[8,8]{1,0} get-tuple-element(%async-collective-start.1), index=1
  %fusion.2 = (f32[8,8]{1,0}, f32[8,8]{1,0}) fusion(%b, %gte), kind=kCustom, calls=%async_collective_fusion.2
  %gte.2 = f32[8,8]{1,0} get-tuple-element(%fusion.2), index=1
  %async-collective-done.1 = f32[8,8]{1,0} fusion(%gte.2), kind=kCustom, calls=%fused_computation.3
  %fusion.4 = f32[1,8]{1,0} fusion(%async-collective-done.1), kind=kCustom, calls=%all-reduce-scatter.4
  ROOT %out = f32[1,8]{1,0} copy(%fusion.4)
}
"""


def test_xla_async_pairs_overlap_when_a_matmul_runs_between():
    found = scheduled_collectives(XLA, 8)
    got = sorted((s.collective.kind, s.overlapped, s.collective.sent_bytes) for s in found)
    assert got == sorted(
        [
            ("all-reduce", False, 2 * 7 / 8 * 256),  # nothing between start and done
            ("reduce-scatter", False, 7 / 8 * 256),  # synchronous
        ]
        + [("all-gather", True, 7 / 8 * 256)] * 2 * 3  # the loop's two, 3 iterations
    )
    assert overlap_bytes(found) == pytest.approx((6 * 224, 448 + 224))
    assert overlap_bytes(found, "all-gather") == pytest.approx((6 * 224, 0))
    assert overlap_bytes(found, "reduce-scatter") == pytest.approx((0, 224))


def test_tpu_async_collective_fusions_and_its_fused_reduce_scatter():
    found = scheduled_collectives(TPU, 8)
    got = sorted((s.collective.kind, s.overlapped, s.collective.sent_bytes) for s in found)
    # the gather's steps inside the matmul fusion are the same collective, not another one;
    # the 'all-reduce-scatter' fusion is counted as the reduce-scatter it runs
    assert got == [("all-gather", True, 224.0), ("reduce-scatter", False, 224.0)]


def test_a_cpu_style_module_exposes_everything():
    sync = XLA.replace("all-gather-start(", "all-gather(").replace("-start(", "(")
    sync = "\n".join(line for line in sync.splitlines() if "-done(" not in line)
    assert all(not s.overlapped for s in scheduled_collectives(sync, 8))


VARIADIC = f"""HloModule v, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

ENTRY %main (a: f32[8,8], b: f32[8]) -> (f32[8,8], f32[8]) {{
  %a = f32[8,8]{{1,0}} parameter(0)
  %b = f32[8]{{0}} parameter(1)
  ROOT %ar = (f32[8,8]{{1,0}}, f32[8]{{0}}) all-reduce(%a, %b), {GROUP}, to_apply=%add
}}
"""


def test_a_collective_moving_two_arrays_is_one_launch():
    # XLA's combiners make one all-reduce of several arrays: one launch, its bytes summed
    scheduled = scheduled_collectives(VARIADIC, 8)
    assert [s.first for s in scheduled] == [True, False]
    assert launches(scheduled) == [("all-reduce", 256 + 32)]
    assert launches(scheduled_collectives(XLA, 8)) == [
        ("all-reduce", 256),
        ("reduce-scatter", 256),
        *[("all-gather", 256)] * 6,
    ]


# XLA:GPU's form (as a compile for compile-only H100s prints it): async starts return
# ((operands...), outputs...), the combiner's all-gather moves two arrays in one launch, cuBLAS
# gemms are custom-calls, Triton gemms fusions holding a dot, and host offload asynchronous
# copies to and from host memory (layout memory space S(5)).
GPU = f"""HloModule g, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

%triton_gemm (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {{
  %p0 = f32[8,8]{{1,0}} parameter(0)
  %p1 = f32[8,8]{{1,0}} parameter(1)
  ROOT %dot.1 = f32[8,8]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

ENTRY %main (a: f32[1,8], b: f32[1,8], c: f32[8,8], h: f32[8,8]) -> f32[8,8] {{
  %a = f32[1,8]{{1,0}} parameter(0)
  %b = f32[1,8]{{1,0}} parameter(1)
  %c = f32[8,8]{{1,0}} parameter(2)
  %h = f32[8,8]{{1,0:S(5)}} parameter(3)
  %all-gather-start = ((f32[1,8]{{1,0}}, f32[1,8]{{1,0}}), (f32[8,8]{{1,0}}, f32[8,8]{{1,0}})) all-gather-start(%a, %b), channel_id=1, replica_groups=mesh['data'=8] {{'data'}}, dimensions={{0}}, use_global_device_ids=true
  %copy-start = (f32[8,8]{{1,0}}, f32[8,8]{{1,0:S(5)}}, u32[]) copy-start(%h)
  %cublas-gemm.1 = (f32[8,8]{{1,0}}, s8[1024]{{0}}) custom-call(%c, %c), custom_call_target="__cublas$lt$matmul", backend_config={{}}
  %all-gather-done = (f32[8,8]{{1,0}}, f32[8,8]{{1,0}}) all-gather-done(%all-gather-start)
  %reduce-scatter-start = ((f32[8,8]{{1,0}}), f32[1,8]{{1,0}}) reduce-scatter-start(%c), channel_id=2, {GROUP}, dimensions={{0}}, to_apply=%add
  %reduce-scatter-done = f32[1,8]{{1,0}} reduce-scatter-done(%reduce-scatter-start)
  %copy-done = f32[8,8]{{1,0}} copy-done(%copy-start)
  %all-reduce-start = ((f32[8,8]{{1,0}}), f32[8,8]{{1,0}}) all-reduce-start(%c), channel_id=3, {GROUP}, to_apply=%add
  %gemm_fusion = f32[8,8]{{1,0}} fusion(%c, %copy-done), kind=kCustom, calls=%triton_gemm
  %copy-start.1 = (f32[8,8]{{1,0:S(5)}}, f32[8,8]{{1,0}}, u32[]) copy-start(%gemm_fusion)
  %all-reduce-done = f32[8,8]{{1,0}} all-reduce-done(%all-reduce-start)
  %copy-done.1 = f32[8,8]{{1,0:S(5)}} copy-done(%copy-start.1)
  ROOT %out = f32[8,8]{{1,0}} add(%all-reduce-done, %gemm_fusion)
}}
"""


def test_an_xla_gpu_module_counts_outputs_launches_cublas_and_host_copies():
    from zerojax.inspect.schedule import host_transfers

    found = scheduled_collectives(GPU, 8)
    # outputs only: the all-gather's two [8,8] outputs (not its [1,8] operands as well), the
    # reduce-scatter's [8,8] input (8 x its [1,8] output, not that plus its operand), the
    # all-reduce's [8,8] (not twice)
    assert launches(found) == [
        ("all-gather", 2 * 256),
        ("reduce-scatter", 256),
        ("all-reduce", 256),
    ]
    # the gathers ran beside the cuBLAS gemm, the all-reduce beside the Triton gemm fusion;
    # nothing ran beside the reduce-scatter
    assert overlap_bytes(found) == pytest.approx((2 * 224 + 2 * 224, 224))
    assert overlap_bytes(found, "reduce-scatter") == (0, 224)
    # the parameter came in beside the cuBLAS gemm; the result went out with nothing beside it
    assert host_transfers(found) == {"host-to-device": (256, 0), "device-to-host": (0, 256)}
