"""The kernel-argument size that launch()'s 4 KB check counts (cuda/runtime.cuh
param_buffer_size), executed on the host (see tests/kernels/test_cuda_host.py for how the module
is built): each argument at its alignment, in order, nothing after the last, as the C layout of a
struct of the same members has them. The check compares it with the limit only at compile time and
our kernels stay ~100 bytes below it, so a miscount would pass every build until a kernel grew;
this test holds the count itself (mutant runtime.cuh:37:arith:e2c4dcef, docs/cuda_mutants.md).
"""
import ctypes

from test_cuda_host import host  # noqa: F401 (a fixture)

_TYPES = {'char': ctypes.c_char, 'int16': ctypes.c_int16, 'int32': ctypes.c_int32,
          'int64': ctypes.c_int64, 'float': ctypes.c_float, 'double': ctypes.c_double}


def _c_layout_end(names):
    """Offset of the last member plus its size, in a C struct of these members."""
    fields = [(f'f{i}', _TYPES[n]) for i, n in enumerate(names)]
    struct = type('Args', (ctypes.Structure,), {'_fields_': fields})
    last = getattr(struct, fields[-1][0])
    return last.offset + ctypes.sizeof(fields[-1][1])


def test_param_buffer_size_is_the_c_layout(host):
    sizes = host.module.param_buffer_sizes
    assert sizes == {k: _c_layout_end(k.split(',')) for k in sizes}
    assert sizes['double,char'] == 9 and sizes['char,double'] == 16
