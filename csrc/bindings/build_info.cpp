// How this extension was built (version, CUDA on or off, GPU architectures, compilers), as JSON, for
// vpaged.build_info() and `vpaged info`: a bug report then names the build. setup.py generates
// build_info.h; the symbol is read through ctypes from this very binary, so the answer cannot come from
// another build's files.
#if __has_include("build_info.h")
#include "build_info.h"
#else
#define VPAGED_BUILD_INFO "{}"  // built without setup.py: nothing known
#endif

extern "C" __attribute__((visibility("default"))) const char* vpaged_build_info() { return VPAGED_BUILD_INFO; }
