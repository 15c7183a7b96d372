/* hitloop: the target of the bench's per-hit probe cost measurement
 * (`cargo xtask bench`, figure "marker ÷ empty uprobe").
 *
 * Prints `ready <pid>`, then for each stdin line `go N` calls bench_hit()
 * N times and prints `done N <elapsed_ns> <thread_cpu_ns>` (CLOCK_MONOTONIC,
 * and CLOCK_THREAD_CPUTIME_ID, which still counts the probe's kernel time
 * but not the time other processes hold the CPU). The bench
 * times the same loop bare, with an empty uprobe on bench_hit, and with the
 * step-marker program (with and without its string filter, which reads the
 * first argument): per-hit cost = (t_probe - t_bare) / N. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

volatile uint64_t hitloop_sink;

__attribute__((noinline, noipa, used, visibility("default")))
void bench_hit(const char *name) {
    hitloop_sink += (unsigned char)name[0];
}

static uint64_t clock_ns(clockid_t c) {
    struct timespec ts;
    clock_gettime(c, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int main(void) {
    static const char name[] = "Optimizer.step#SGD.step";
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    char line[128];
    while (fgets(line, sizeof line, stdin)) {
        unsigned long long n = 0;
        if (sscanf(line, "go %llu", &n) != 1) continue;
        uint64_t c0 = clock_ns(CLOCK_THREAD_CPUTIME_ID), t0 = clock_ns(CLOCK_MONOTONIC);
        for (unsigned long long i = 0; i < n; i++) bench_hit(name);
        uint64_t t1 = clock_ns(CLOCK_MONOTONIC), c1 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
        printf("done %llu %llu %llu\n", n, (unsigned long long)(t1 - t0), (unsigned long long)(c1 - c0));
        fflush(stdout);
    }
    return 0;
}
