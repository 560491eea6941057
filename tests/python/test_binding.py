"""The ctypes binding (python/megamoe/_lib.py) against the C header it mirrors
(include/megamoe/megamoe.h): every function with its return and argument types, the struct
fields, the dtype codes and the array bounds. A change to one side without the other fails
here, on the CPU, before a call with the wrong types corrupts memory on a GPU."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from megamoe import _lib

HEADER = Path(__file__).resolve().parents[2] / "include" / "megamoe" / "megamoe.h"

# megamoe_dtype's names for torch's dtypes.
TORCH_DTYPES = {
    "FLOAT32": torch.float32, "FLOAT64": torch.float64, "BFLOAT16": torch.bfloat16,
    "FLOAT16": torch.float16, "INT32": torch.int32, "INT64": torch.int64,
    "FLOAT8_E4M3": torch.float8_e4m3fn,
}
SCALARS = {
    "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64,
    "size_t": ctypes.c_size_t, "int": ctypes.c_int, "char": ctypes.c_char,
}
STRUCTS = {"megamoe_tensor": _lib.TensorDescriptor, "megamoe_ep_group": _lib.EpGroupStruct}
MACROS = {"MEGAMOE_MAX_DIMS": _lib.MAX_DIMS, "MEGAMOE_EP_MAX_RANKS": _lib.MAX_RANKS}


# --- a parser of the declarations megamoe.h uses -------------------------------------------

class Header:
    """Integer macros, enums, structs and function declarations of a C header. It knows the
    forms this header writes (`typedef enum/struct name { ... } name;`, one field per
    declaration, `MEGAMOE_API type name(params);`) and fails on a declaration it cannot read,
    so a new form shows up as a test failure rather than as a declaration skipped."""

    def __init__(self, text: str):
        text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
        text = re.sub(r"//[^\n]*", " ", text)
        self.macros = {m[1]: int(m[2]) for m in
                       re.finditer(r"^\s*#\s*define\s+(\w+)\s+(-?\d+)\s*$", text, flags=re.M)}
        code = re.sub(r"^\s*#[^\n]*", " ", text, flags=re.M)
        self.enums, self.structs, self.functions = {}, {}, {}
        for kind, name, body, alias in re.findall(
                r"typedef\s+(enum|struct)\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", code, flags=re.S):
            assert name == alias, f"typedef {kind} {name} is named {alias}"
            (self._enum if kind == "enum" else self._struct)(name, body)
        for ret, name, params in re.findall(r"MEGAMOE_API\s+([^;(]+?)\s*\b(\w+)\s*\(([^)]*)\)\s*;",
                                            code):
            args = [] if params.strip() in ("", "void") else [
                self._declarator(p)[0] for p in params.split(",")]
            self.functions[name] = (self._type(ret), args)
        assert code.count("MEGAMOE_API") == len(self.functions), "an MEGAMOE_API line not parsed"

    def _enum(self, name, body):
        values, next_value = {}, 0
        for item in filter(None, (i.strip() for i in body.split(","))):
            member, _, value = (s.strip() for s in item.partition("="))
            next_value = int(value) if value else next_value
            values[member] = next_value
            next_value += 1
        self.enums[name] = values

    def _struct(self, name, body):
        fields = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            ctype, field, length = self._declarator(decl)
            fields.append((field, ctype if length is None else ctype * length))
        self.structs[name] = fields

    def _declarator(self, decl: str):
        """(ctypes type, name, array length or None) of `const T* name[N]`."""
        m = re.fullmatch(r"\s*(.+?)\s*\b(\w+)\s*(?:\[\s*(\w+)\s*\])?\s*", decl)
        assert m, f"cannot read the declaration {decl!r}"
        length = m[3] and (int(m[3]) if m[3].isdigit() else self.macros[m[3]])
        return self._type(m[1]), m[2], length

    def _type(self, spelling: str):
        """The ctypes type that mirrors a C type spelled like `const megamoe_tensor*`."""
        words = spelling.replace("*", " * ").split()
        words = [w for w in words if w != "const"]
        stars = words.count("*")
        base = " ".join(w for w in words if w != "*")
        if base == "char" and stars == 1:
            return ctypes.c_char_p
        if base == "void":
            assert stars <= 1, spelling
            return ctypes.c_void_p if stars else None
        if base in SCALARS:
            t = SCALARS[base]
        elif base in self.enums:
            t = ctypes.c_int  # a C enum whose values fit an int is an int
        elif base in STRUCTS:
            t = STRUCTS[base]
        else:
            raise AssertionError(f"no ctypes mirror for the C type {spelling!r}")
        for _ in range(stars):
            t = ctypes.POINTER(t)
        return t


def same_type(a, b) -> bool:
    """ctypes types that are one C type (c_int is c_int32 on this ABI, arrays compare by
    element type and length)."""
    if a is None or b is None:
        return a is b
    if issubclass(a, ctypes.Array) and issubclass(b, ctypes.Array):
        return a._length_ == b._length_ and same_type(a._type_, b._type_)
    if issubclass(a, ctypes._Pointer) and issubclass(b, ctypes._Pointer):
        return same_type(a._type_, b._type_)
    if issubclass(a, ctypes.Structure) or issubclass(b, ctypes.Structure):
        return a is b
    return a is b or (ctypes.sizeof(a) == ctypes.sizeof(b)
                      and getattr(a, "_type_", None) == getattr(b, "_type_", None))


def name(t) -> str:
    return "void" if t is None else t.__name__


@pytest.fixture(scope="module")
def header() -> Header:
    return Header(HEADER.read_text())


# --- the binding against the header ----------------------------------------------------------

def test_every_function_is_declared_with_the_header_types(header):
    assert set(_lib.SIGNATURES) == set(header.functions), (
        f"only in megamoe.h: {sorted(set(header.functions) - set(_lib.SIGNATURES))}; "
        f"only in _lib.SIGNATURES: {sorted(set(_lib.SIGNATURES) - set(header.functions))}")
    for fn, (ret, args) in header.functions.items():
        bound_ret, bound_args = _lib.SIGNATURES[fn]
        assert same_type(bound_ret, ret), f"{fn} returns {name(ret)}, bound as {name(bound_ret)}"
        assert len(bound_args) == len(args), (
            f"{fn} takes {len(args)} arguments, bound {len(bound_args)}")
        for i, (bound, c) in enumerate(zip(bound_args, args)):
            assert same_type(bound, c), f"{fn} argument {i}: {name(c)} in C, {name(bound)} bound"


def test_declare_applies_the_signatures():
    class Recorder:  # stands in for the CDLL: records what _declare sets on each function
        def __init__(self):
            self.functions = {}

        def __getattr__(self, fn):
            return self.functions.setdefault(fn, type("Function", (), {})())

    lib = Recorder()
    _lib._declare(lib)
    assert {fn: (f.restype, f.argtypes) for fn, f in lib.functions.items()} == _lib.SIGNATURES


@pytest.mark.parametrize("c_name,mirror", list(STRUCTS.items()))
def test_struct_fields_match(header, c_name, mirror):
    fields = [(f, t) for f, t in mirror._fields_]
    c_fields = header.structs[c_name]
    assert [f for f, _ in fields] == [f for f, _ in c_fields], c_name
    for (field, t), (_, c_type) in zip(fields, c_fields):
        assert same_type(t, c_type), f"{c_name}.{field}: {name(c_type)} in C, {name(t)} bound"


def test_array_bounds_and_dtype_codes_match(header):
    for macro, value in MACROS.items():
        assert header.macros[macro] == value, macro
    codes = {member.removeprefix("MEGAMOE_DTYPE_"): value
             for member, value in header.enums["megamoe_dtype"].items()}
    assert set(codes) <= set(TORCH_DTYPES), f"a megamoe_dtype member has no torch dtype: {codes}"
    assert {TORCH_DTYPES[n]: v for n, v in codes.items()} == _lib._DTYPE_CODES


def test_package_version_is_the_header_version(header):
    import megamoe
    version = ".".join(str(header.macros[f"MEGAMOE_VERSION_{part}"])
                       for part in ("MAJOR", "MINOR", "PATCH"))
    assert megamoe.__version__ == version


def test_parser_reads_what_it_must_and_refuses_what_it_cannot():
    h = Header("""
        #define N 3
        typedef enum e { A = 4, B, C = 9 } e;
        typedef struct s { const void* p; e kind; int64_t v[N]; } s;
        MEGAMOE_API e f(const megamoe_tensor* a, size_t n, char* out);
        MEGAMOE_API void g(void);""")
    assert h.enums["e"] == {"A": 4, "B": 5, "C": 9}
    assert [(f, name(t)) for f, t in h.structs["s"]] == [
        ("p", "c_void_p"), ("kind", name(ctypes.c_int)), ("v", name(ctypes.c_int64 * 3))]
    ret, args = h.functions["f"]
    assert same_type(ret, ctypes.c_int) and same_type(args[0], ctypes.POINTER(_lib.TensorDescriptor))
    assert same_type(args[1], ctypes.c_size_t) and args[2] is ctypes.c_char_p
    assert h.functions["g"] == (None, [])
    with pytest.raises(AssertionError, match="no ctypes mirror"):
        Header("MEGAMOE_API float h(void);")
    with pytest.raises(AssertionError, match="not parsed"):
        Header("MEGAMOE_API int32_t (*h)(void);")
    assert not same_type(ctypes.c_int32, ctypes.c_int64)
    assert not same_type(ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int32))
    assert not same_type(ctypes.c_int64 * 4, ctypes.c_int64 * 3)


# --- the layout the C compiler gives, and the library that is built --------------------------

def _c_compiler():
    for cc in ("cc", "gcc", "clang"):
        if shutil.which(cc):
            return cc
    return None


def test_struct_layouts_match_the_c_compiler(tmp_path):
    cc = _c_compiler()
    if cc is None:
        pytest.skip("no C compiler on PATH")
    lines = []
    for c_name, mirror in STRUCTS.items():
        lines.append(f'printf("{c_name} %zu\\n", sizeof({c_name}));')
        lines += [f'printf("{c_name}.{f} %zu\\n", offsetof({c_name}, {f}));' for f, _ in mirror._fields_]
    source = tmp_path / "layout.c"
    source.write_text("#include <stddef.h>\n#include <stdio.h>\n#include <megamoe/megamoe.h>\n"
                      "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n")
    subprocess.run([cc, f"-I{HEADER.parents[1]}", str(source), "-o", str(tmp_path / "layout")],
                   check=True)
    out = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True, text=True)
    c_layout = dict(line.split() for line in out.stdout.splitlines())
    for c_name, mirror in STRUCTS.items():
        assert int(c_layout[c_name]) == ctypes.sizeof(mirror), c_name
        for f, _ in mirror._fields_:
            assert int(c_layout[f"{c_name}.{f}"]) == getattr(mirror, f).offset, f"{c_name}.{f}"


def test_library_exports_the_header_and_agrees_on_dtype_sizes(header):
    try:
        lib = _lib.library()
    except Exception as err:  # noqa: BLE001 - no built library is a skip, not a failure
        pytest.skip(f"no library: {err}")
    for fn in header.functions:
        assert hasattr(lib, fn), f"libmegamoe.so does not export {fn}"
    for dtype, code in _lib._DTYPE_CODES.items():
        assert lib.megamoe_dtype_size(code) == dtype.itemsize, dtype
    assert lib.megamoe_dtype_size(len(_lib._DTYPE_CODES)) == 0
    assert _lib.library_version() == ".".join(
        str(header.macros[f"MEGAMOE_VERSION_{p}"]) for p in ("MAJOR", "MINOR", "PATCH"))
