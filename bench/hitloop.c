/* hitloop: the target of the bench's per-hit probe cost measurement
 * (`cargo xtask bench`, section 6, "probe cost by first instruction").
 *
 * Prints `ready <pid>`, then for each stdin line `go SITE N` calls the
 * function SITE N times and prints `done N <elapsed_ns> <thread_cpu_ns>`
 * (CLOCK_MONOTONIC, and CLOCK_THREAD_CPUTIME_ID, which still counts the
 * probe's kernel time but not the time other processes hold the CPU).
 * `go N` alone calls bench_hit (the historical site).
 *
 * The uprobe's cost depends on the probed (first) instruction, so each site
 * is written in assembly, where no compiler can change it:
 *   bench_push    push %rbx                 the kernel emulates it
 *   bench_nop5    nopl 0x0(%rax,%rax,1)     5-byte nop, skipped
 *   bench_riprel  mov hitloop_sink(%rip),%rdx  single-stepped out of line
 *   bench_endbr   endbr64                   what CET builds begin with
 * Every site leaves %rdi (the name) alone, so the marker's string filter
 * (arg=0:cstr) reads the same string at each.
 *
 * The bench times the same loop bare, with an empty uprobe, and with the
 * step-marker program (with and without its string filter):
 * per-hit cost = (t_probe - t_bare) / N. */
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

void bench_push(const char *name);
void bench_nop5(const char *name);
void bench_riprel(const char *name);
void bench_endbr(const char *name);

#if defined(__x86_64__)
__asm__(
    ".text\n"
    ".globl bench_push\n"
    ".type bench_push,@function\n"
    "bench_push:\n"
    "    push %rbx\n"
    "    pop %rbx\n"
    "    ret\n"
    ".size bench_push, .-bench_push\n"
    ".globl bench_nop5\n"
    ".type bench_nop5,@function\n"
    "bench_nop5:\n"
    "    .byte 0x0f, 0x1f, 0x44, 0x00, 0x00\n"
    "    ret\n"
    ".size bench_nop5, .-bench_nop5\n"
    ".globl bench_riprel\n"
    ".type bench_riprel,@function\n"
    "bench_riprel:\n"
    "    mov hitloop_sink(%rip), %rdx\n"
    "    ret\n"
    ".size bench_riprel, .-bench_riprel\n"
    ".globl bench_endbr\n"
    ".type bench_endbr,@function\n"
    "bench_endbr:\n"
    "    .byte 0xf3, 0x0f, 0x1e, 0xfa\n"
    "    ret\n"
    ".size bench_endbr, .-bench_endbr\n");
#elif defined(__aarch64__)
/* arm64 uprobes simulate branches, adr/adrp and literal loads, and
 * single-step everything else out of line (5.10: nops and other hints
 * too). The same four names, with arm64's instructions:
 *   bench_push    stp x29, x30, [sp, #-16]!   the usual prologue: stepped
 *   bench_nop5    nop                          stepped on 5.10
 *   bench_riprel  adrp x1, hitloop_sink        pc-relative: simulated
 *   bench_endbr   b 1f (to the next insn)      a branch: simulated
 * x0 (the name) is left alone. */
__asm__(
    ".text\n"
    ".globl bench_push\n"
    ".type bench_push,%function\n"
    "bench_push:\n"
    "    stp x29, x30, [sp, #-16]!\n"
    "    ldp x29, x30, [sp], #16\n"
    "    ret\n"
    ".size bench_push, .-bench_push\n"
    ".globl bench_nop5\n"
    ".type bench_nop5,%function\n"
    "bench_nop5:\n"
    "    nop\n"
    "    ret\n"
    ".size bench_nop5, .-bench_nop5\n"
    ".globl bench_riprel\n"
    ".type bench_riprel,%function\n"
    "bench_riprel:\n"
    "    adrp x1, hitloop_sink\n"
    "    ret\n"
    ".size bench_riprel, .-bench_riprel\n"
    ".globl bench_endbr\n"
    ".type bench_endbr,%function\n"
    "bench_endbr:\n"
    "    b 1f\n"
    "1:  ret\n"
    ".size bench_endbr, .-bench_endbr\n");
#else
/* Other architectures: plain C, so the fixture still builds; the classes
 * above are x86-64's. */
__attribute__((noinline, noipa, used, visibility("default"))) void bench_push(const char *n) { bench_hit(n); }
__attribute__((noinline, noipa, used, visibility("default"))) void bench_nop5(const char *n) { bench_hit(n); }
__attribute__((noinline, noipa, used, visibility("default"))) void bench_riprel(const char *n) { bench_hit(n); }
__attribute__((noinline, noipa, used, visibility("default"))) void bench_endbr(const char *n) { bench_hit(n); }
#endif

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
        char site[32] = "hit";
        if (sscanf(line, "go %31s %llu", site, &n) != 2) {
            strcpy(site, "hit");
            if (sscanf(line, "go %llu", &n) != 1) continue;
        }
        void (*volatile fn)(const char *);
        if (!strcmp(site, "hit")) fn = bench_hit;
        else if (!strcmp(site, "push")) fn = bench_push;
        else if (!strcmp(site, "nop5")) fn = bench_nop5;
        else if (!strcmp(site, "riprel")) fn = bench_riprel;
        else if (!strcmp(site, "endbr")) fn = bench_endbr;
        else {
            printf("error unknown site %s\n", site);
            fflush(stdout);
            continue;
        }
        void (*f)(const char *) = fn;
        uint64_t c0 = clock_ns(CLOCK_THREAD_CPUTIME_ID), t0 = clock_ns(CLOCK_MONOTONIC);
        for (unsigned long long i = 0; i < n; i++) f(name);
        uint64_t t1 = clock_ns(CLOCK_MONOTONIC), c1 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
        printf("done %llu %llu %llu\n", n, (unsigned long long)(t1 - t0), (unsigned long long)(c1 - c0));
        fflush(stdout);
    }
    return 0;
}
