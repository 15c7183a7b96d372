#define _SDT_HAS_SEMAPHORES 1
#include <sys/sdt.h>
unsigned short dynprof_step_semaphore __attribute__((section(".probes")));
unsigned short dynprof_tick_semaphore __attribute__((section(".probes")));
__attribute__((noinline)) void train_step(long n, const char *s) {
    if (dynprof_step_semaphore) STAP_PROBE2(dynprof, step, n, s);
    STAP_PROBE1(dynprof, tick, n);
}
void _start(void) { for (;;) train_step(1, "x"); }
