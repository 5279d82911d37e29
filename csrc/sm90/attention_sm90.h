/* The Hopper (wgmma + TMA) attention kernels, as seen by the generic CUDA launchers. */
#pragma once

#include <cuda_runtime.h>

#include "binding/attn_qat.h"

/* Runs the forward on the wgmma kernel when this device, this build and these operands allow it; *taken says
   whether it ran. When *fallback_flag comes back non-NULL, the caller must still launch the mma.sync forward on
   the same stream, doing its work only if the device flag is set (hidden keys with non-finite values, which that
   kernel handles). Returns NULL or an error message. */
const char *aq_attention_fwd_sm90(const aq_attention_fwd_params *p, cudaStream_t stream, bool *taken,
                                  const int **fallback_flag);

/* The same for the backward's dK/dV and dQ kernels (the delta kernel has run before). */
const char *aq_attention_bwd_sm90(const aq_attention_bwd_params *p, cudaStream_t stream, bool *taken,
                                  const int **fallback_flag);
