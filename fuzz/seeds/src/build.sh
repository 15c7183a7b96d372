#!/bin/sh
# Rebuilds the ELF seeds in ../elf (docs/fuzzing.md). Needs gcc, g++,
# binutils and systemtap-sdt-dev (sys/sdt.h). Run from this directory.
set -eu
out=../elf
# A static executable with two USDT probes (one with a semaphore) and a build id.
gcc -Os -nostdlib -static -fno-asynchronous-unwind-tables -Wl,--build-id \
    -Wl,-z,max-page-size=0x1000 -Wl,-z,noseparate-code -o "$out/usdt_exe" usdt.c
# A shared library with a C++ method whose demangled name a --marker uses.
g++ -Os -shared -fPIC -nostdlib -fno-asynchronous-unwind-tables -Wl,--build-id \
    -Wl,-z,max-page-size=0x1000 -Wl,-z,noseparate-code -o "$out/libtorch_tiny.so" lib.cc
# Debian's python3 cut down to its real .note.stapsdt (656 bytes, 12 probes).
objcopy --only-section=.note.stapsdt --only-section=.stapsdt.base \
    /usr/bin/python3 "$out/python3_stapsdt_only" 2>/dev/null
