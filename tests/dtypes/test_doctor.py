"""hardware/doctor.py and its lines in ``python -m mp_wrappers``: 8-bit optimizer states (where the
update runs, CUDA's refusal, bytes per param), and their self-test case against the reference."""
import pytest
import torch

from mp_wrappers import __main__ as doctor
from mp_wrappers import selftest
from mp_wrappers.hardware import doctor as hardware_doctor
from mp_wrappers.ops import _extension, reference
from mp_wrappers.optim import FusedAdam, FusedSGD


def test_reports_the_kernel_flavour_that_runs_the_8bit_update():
    ext = _extension.extension()
    if ext is None:
        pytest.skip('the C++ extension is not built')
    assert hardware_doctor.quantized_states_info()['cpu'] == f'cpp-{ext.cpu_isa()}'
    previous = ext._set_cpu_isa('baseline')
    try:
        info = hardware_doctor.quantized_states_info()
        assert info['cpu'] == 'cpp-baseline' and info['cuda'] is None
        assert doctor._quantized_lines(info)[0] == 'cpu          cpp-baseline kernel'
    finally:
        ext._set_cpu_isa(previous)


def test_without_the_extension_the_reference_is_reported(monkeypatch):
    monkeypatch.setattr(_extension, 'extension', lambda: None)
    info = hardware_doctor.quantized_states_info()
    assert info['cpu'] == 'reference'
    assert 'the pure-PyTorch reference runs' in doctor._quantized_lines(info)[0]


def test_bytes_per_param_are_what_the_optimizer_keeps():
    info = hardware_doctor.quantized_states_info()
    fp32, int8 = info['bytes_per_param']['Adam moments']
    assert (fp32, int8) == (8.0, 2 + 8 / 256)
    assert info['bytes_per_param']['O2 bf16: model + fp32 master + Adam'] == (14.0, 6 + int8)
    param = torch.nn.Parameter(torch.randn(64, 256))
    opt = FusedAdam([param], lr=1e-3, state_dtype='int8')
    param.grad = torch.randn_like(param)
    opt.step()
    moments = [v for k, v in opt.state[param].items() if k != 'step']
    assert sum(v.numel() * v.element_size() for v in moments) / param.numel() == int8
    assert info['bytes_per_param']['SGD momentum buffer (FusedSGD)'] == (4.0, 1 + 4 / 256)
    sgd = FusedSGD([param], lr=0.1, momentum=0.9, state_dtype='int8')
    sgd.step()
    buffer = [v for k, v in sgd.state[param].items() if k != 'step']
    assert sum(v.numel() * v.element_size() for v in buffer) / param.numel() == 1 + 4 / 256


def test_doctor_prints_the_section_and_cudas_refusal(capsys):
    assert doctor.main(['--no-selftest']) == 0
    out = capsys.readouterr().out
    section = out.split("-- 8-bit optimizer states (FusedAdam / FusedSGD(state_dtype='int8'))\n")[1]
    lines = section.split('\n\n')[0].splitlines()
    assert lines[0].startswith('cpu          ')
    assert "state_dtype='int8' are refused (NotImplementedError)" in lines[1]
    assert "optim_wrapper.optimizer.state_dtype='float32'" in lines[1]
    assert lines[2].startswith("sgd          FusedSGD(state_dtype='int8'): cpp-")
    assert "on cpu, no CUDA kernel (CUDA params refused); fp32 / half params, and bf16 params " \
           "with a lean master_weights ('split', 'kahan', 'stochastic')" in lines[2]
    assert lines[-1] == '             O2 bf16: model + fp32 master + Adam: 14.00 -> 8.03'


def test_doctor_names_the_cuda_kernel_where_the_build_has_it():
    info = dict(hardware_doctor.quantized_states_info(), cuda='cuda')
    assert doctor._quantized_lines(info)[1] == 'cuda         cuda kernel'
    assert 'no CUDA kernel' in doctor._quantized_lines(info)[2]  # SGD's op has its own
    info['sgd_cuda'] = 'cuda'
    assert 'on cpu, cuda kernel;' in doctor._quantized_lines(info)[2]


def test_selftest_checks_the_8bit_kernel_like_every_op(monkeypatch):
    if _extension.extension() is None:
        pytest.skip('the C++ extension is not built: nothing compiled to self-test')
    # Kernels on CPU and CUDA: self-tested on every device the build covers.
    selftest._check_op('multi_tensor_adam8bit_', 'cpu')  # bit for bit: codes compared exactly
    right = reference.multi_tensor_adam8bit_

    def one_code_off(*args):
        right(*args)
        args[2][0][0] ^= 1  # the first exp_avg code of the first tensor
    monkeypatch.setattr(reference, 'multi_tensor_adam8bit_', one_code_off)
    with pytest.raises(AssertionError, match=r'tensor 8: '):  # after 4 params and 4 grads
        selftest._check_op('multi_tensor_adam8bit_', 'cpu')
    # Asked for CUDA, a build without CUDA kernels reports it as it reports every other op.
    results, _, _ = selftest.run_selftest(['cuda'])
    ours = [r for r in results if r.op == 'multi_tensor_adam8bit_']
    others = [r for r in results if r.op == 'multi_tensor_adam_']
    assert [(r.ok, r.error) for r in ours] == [(r.ok, r.error) for r in others]


def test_selftest_checks_the_8bit_sgd_kernel_like_every_op(monkeypatch):
    if _extension.extension() is None:
        pytest.skip('the C++ extension is not built: nothing compiled to self-test')
    # Kernels on CPU and CUDA: asked for CUDA, it is reported as every other op is.
    results, _, _ = selftest.run_selftest(['cuda'])
    ours = [r for r in results if r.op == 'multi_tensor_sgd8bit_']
    others = [r for r in results if r.op == 'multi_tensor_sgd_']
    assert ours and [(r.ok, r.error) for r in ours] == [(r.ok, r.error) for r in others]
    selftest._check_op('multi_tensor_sgd8bit_', 'cpu')
    right = reference.multi_tensor_sgd8bit_

    def one_code_off(params, grads, codes, *rest):
        right(params, grads, codes, *rest)
        codes[1][3] ^= 1
    monkeypatch.setattr(reference, 'multi_tensor_sgd8bit_', one_code_off)
    with pytest.raises(AssertionError, match='tensor'):
        selftest._check_op('multi_tensor_sgd8bit_', 'cpu')


def test_every_declared_op_has_a_selftest_case():
    if _extension.extension() is None:
        pytest.skip('the C++ extension is not built: nothing compiled to self-test')
    assert set(selftest.declared_ops()) - set(selftest.CASES) == set()


@pytest.mark.parametrize('op', ['multi_tensor_adam_lean_', 'multi_tensor_sgd_lean_',
                                'multi_tensor_adam8bit_lean_', 'multi_tensor_sgd8bit_lean_'])
def test_selftest_checks_the_lean_kernels_and_their_aux_state(monkeypatch, op):
    """The lean ops (bf16 params stored 'kahan'): their kernels agree with the references, and a
    compensation off by one element's worth is caught."""
    if _extension.extension() is None:
        pytest.skip('the C++ extension is not built: nothing compiled to self-test')
    selftest._check_op(op, 'cpu')
    right = getattr(reference, op)

    def compensation_off(params, aux, *rest):
        right(params, aux, *rest)
        aux[1][3] += 1.0
    monkeypatch.setattr(reference, op, compensation_off)
    with pytest.raises(AssertionError, match='tensor'):
        selftest._check_op(op, 'cpu')
