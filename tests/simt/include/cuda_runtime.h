// The CUDA runtime as the host SIMT emulator provides it (tests/simt/simt.h).
#pragma once
#include "../simt.h"
