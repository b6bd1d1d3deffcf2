// ferry/ferry.h — the whole public API in one include.
#pragma once

#include "ferry/collate/collate.h"
#include "ferry/core/allocator.h"
#include "ferry/core/dataloader.h"
#include "ferry/core/dataset.h"
#include "ferry/core/diagnostics.h"
#include "ferry/core/dlpack.h"
#include "ferry/core/error.h"
#include "ferry/core/parallel.h"
#include "ferry/core/random.h"
#include "ferry/core/sampler.h"
#include "ferry/core/tensor.h"
#include "ferry/pinning/cuda.h"
#include "ferry/pinning/device.h"
#include "ferry/pinning/fence.h"
#include "ferry/pinning/pin.h"
#include "ferry/pinning/pool.h"
