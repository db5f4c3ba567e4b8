#pragma once

#include <torch/csrc/stable/tensor.h>

// Ops registered in namespace TORCH_EXTENSION_NAME (docs/design.md "Compiled CUDA ops"). All tensors are 2-D
// [M, d], one dtype (fp32/fp16/bf16), one CUDA device, last-dim stride 1, any row stride. They write their
// outputs and return nothing; autograd lives in the Python package.

// geglu_fwd(Tensor(a!) out, Tensor gate, Tensor up, bool tanh) -> ()
void geglu_fwd(const torch::stable::Tensor& out, const torch::stable::Tensor& gate, const torch::stable::Tensor& up,
               bool tanh);

// geglu_bwd(Tensor(a!) d_gate, Tensor(b!) d_up, Tensor grad, Tensor gate, Tensor up, bool tanh) -> ()
void geglu_bwd(const torch::stable::Tensor& d_gate, const torch::stable::Tensor& d_up,
               const torch::stable::Tensor& grad, const torch::stable::Tensor& gate,
               const torch::stable::Tensor& up, bool tanh);
