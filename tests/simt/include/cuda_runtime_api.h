// The CUDA runtime as the host SIMT emulator provides it (tests/simt/simt.h): found before any
// real CUDA header by the emulator's include path.
#pragma once
#include "../simt.h"
