"""tools/profile_layer.py's kernel names: a grouped GEMM reduced to its grouping, mainloop, A
loader, epilogues and width, so that two GEMMs of a layer never print alike."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from profile_layer import short_name  # noqa: E402

NS = "megamoe::sm90::"


def _gemm(grouping: int, mainloop: str, loader: str, epilogue: str) -> str:
    return (f"void {NS}grouped_gemm_kernel<{NS}GroupedGemm<({NS}Grouping){grouping}, "
            f"{NS}{mainloop}, {NS}{loader}<{NS}{mainloop}>, {NS}BTma<{NS}{mainloop}, "
            f"({NS}BColumns)0>, {NS}{epilogue}>>({NS}GroupedGemm<...>::Params)")


def test_grouped_gemms_are_told_apart():
    fp8 = f"MainloopFp8<({NS}BScales)0, ({NS}BColumns)1, 256>"
    rows_out = _gemm(0, fp8, "ATma", f"SwiGLUSavedHEpilogue<256, {NS}Fp8RowsEpilogue<256, "
                                     f"{NS}SwiGLUValues<256>>>")
    bf16_out = _gemm(0, fp8, "ATma", f"SwiGLUSavedHEpilogue<256, {NS}SwiGLUEpilogue<256>>")
    assert short_name(rows_out) == (
        "grouped_gemm M MainloopFp8 ATma SwiGLUSavedHEpilogue/Fp8RowsEpilogue<256>")
    assert short_name(bf16_out) == (
        "grouped_gemm M MainloopFp8 ATma SwiGLUSavedHEpilogue/SwiGLUEpilogue<256>")
    gathered = _gemm(0, "MainloopBf16<128, (megamoe::sm90::Major)0, (megamoe::sm90::Major)1>",
                     "AGathered", "StoreEpilogue<128, megamoe::sm90::AccumulatorValues<128>>")
    assert short_name(gathered) == "grouped_gemm M MainloopBf16 AGathered StoreEpilogue<128>"
    wgrad = _gemm(1, "MainloopBf16<256, (megamoe::sm90::Major)1, (megamoe::sm90::Major)1>",
                  "ATma", "WeightGradEpilogue<256>")
    assert short_name(wgrad) == "grouped_gemm K MainloopBf16 ATma WeightGradEpilogue<256>"


def test_other_kernels_lose_only_their_namespaces():
    name = ("void megamoe::(anonymous namespace)::quantize_fp8_kernel<(megamoe::Fp8Blocks)0, "
            "true, false>(megamoe::Fp8QuantizeArgs, long, long)")
    assert short_name(name) == (
        "quantize_fp8_kernel<(Fp8Blocks)0, true, false>(Fp8QuantizeArgs, long, long)")
    cublas = "ampere_bf16_s16816gemm_bf16_128x128"
    assert short_name(cublas) == cublas


def test_an_epilogue_named_again_in_its_params_is_named_once():
    epilogue = f"{NS}SwiGLUSavedHEpilogue<256, {NS}StoreEpilogue<256>>"
    name = _gemm(0, "MainloopBf16<256>", "AGathered", epilogue).replace(
        f"{NS}GroupedGemm<...>::Params", f"{NS}GroupedGemm<{epilogue}>::Params")
    assert short_name(name) == (
        "grouped_gemm M MainloopBf16 AGathered SwiGLUSavedHEpilogue/StoreEpilogue<256>")
