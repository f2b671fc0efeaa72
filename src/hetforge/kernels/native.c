/* hetforge native CPU kernels, fp32: one-row products (the GEMVs of a decode step) and the row ops
 * between them (norms, rotary, the decode attention).
 *
 * Why: a decode step reads every weight once, so it is bound by memory bandwidth. ATen runs a one-row
 * linear as a single-threaded MKL GEMV, and a bmm over a chunked view of the weight uses both cores but still
 * reads below the memory's speed. These loops stream each weight once in contiguous chunks, as fast as a plain
 * read of memory (figures: docs/arch/runtime.md, native kernels). Plain C: the compiler vectorizes
 * the loops (-O3 -march=native); the one-row products' inner loops also have AVX-512 / AVX2 versions by
 * hand that round exactly as the plain C does (same bits on every path). The one-row kernels of a decode
 * step run on this file's own small thread
 * pool (below: chunks claimed by whoever runs, so a descheduled thread stalls nobody); the row ops'
 * prefill-sized work and the bandwidth probe use OpenMP from the libgomp that torch has already loaded
 * (torch's thread pool). Built and loaded by native.py. */
#define _GNU_SOURCE
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* An OpenMP team size: at least one (num_threads(0) would mean "the default", possibly more threads than
 * a caller's per-thread scratch has rows). */
static int clamp_threads(int threads) { return threads < 1 ? 1 : threads; }

/* A 64-byte-aligned scratch of `need` bytes for the calling thread, kept in `slot` between calls when it is at most
 * `keep` bytes (a fresh block of a few MiB is an mmap whose page faults every call would pay), else a fresh block:
 * release it with scratch_done. NULL when it cannot be allocated. Each kernel keeps its own thread-local slot. */
typedef struct {
    void *p;
    size_t bytes;
} hf_scratch;

static void *scratch_get(hf_scratch *slot, size_t need, size_t keep) {
    if (slot->p && need <= slot->bytes) return slot->p;
    void *p = aligned_alloc(64, (need + 63) / 64 * 64 + (need == 0 ? 64 : 0));
    if (p && need <= keep) free(slot->p), slot->p = p, slot->bytes = need;
    return p;
}

static void scratch_done(const hf_scratch *slot, void *p) {
    if (p != slot->p) free(p);
}

/* ---------------------------------------------------------------- the decode kernels' thread pool
 * Why not an OpenMP team: every OpenMP region ends at a barrier that waits for *every* team thread, and
 * libgomp's idle threads spin for a long time (300000 rounds by default) before sleeping. When another busy
 * process shares the cores, one team thread is often descheduled for a whole time slice (milliseconds):
 * each of a decode step's ~100 regions then waits for it, and the spinning threads take the CPU time that
 * the descheduled one needs (measured: a 2-thread decode step 20x slower than a 1-thread one).
 *
 * Here a call is cut into many small chunks (~128 KiB of weight each) and every thread, the caller
 * included, claims chunks with atomic counters: first those of its own run of consecutive chunks (one run
 * per thread, so each thread streams one contiguous block), then whatever is left of the others' runs. The
 * caller starts at once and, when the chunks run out, waits only for chunks that a helper has already
 * claimed, never for a helper that has not shown up: a descheduled helper's share is done by whoever runs.
 * Helpers that find no work spin briefly (``spin_us``, default HF_SPIN_US = 50 µs: enough to stay awake
 * between the back-to-back kernels of one step; longer spins trade speed under a busy neighbour for speed on
 * an idle host, see kernels.native.SPIN_US) and then sleep on a futex, so an idle helper gives its core back;
 * the caller, waiting for a claimed chunk, yields after the same spin. Chunks are fixed by the problem (not
 * by the thread count or by who ran them), so a result does not depend on the thread count or on timing.
 * One job at a time: a second concurrent caller (another Python thread) runs its job inline. After fork()
 * the child has no helpers; the caller then does every chunk itself (still correct).
 *
 * What chunks alone cannot hide is a helper descheduled while it holds a chunk: the caller would wait for it for
 * the rest of the busy neighbour's time slice (milliseconds; a chunk takes microseconds). So a caller that has
 * waited ``steal_us`` (HF_STEAL_US) for a claimed chunk takes it over (steal_chunks): it marks the chunk taken,
 * sends the helper a signal whose handler leaves the chunk by siglongjmp (a descheduled thread runs a pending
 * handler before any code of its own), and runs the chunk itself: the same chunk, so the same bits. The helper
 * then keeps the share of its core that the neighbour leaves it, where going solo (below) gave it up. Two steals
 * within HF_QUIET_PAIR_US start a quiet period (HF_QUIET_US) in which idle helpers sleep at once instead of
 * spinning: a helper spinning on the neighbour's core burns the share it gets there. And a helper that joins a job
 * on the caller's CPU moves to the process's other CPUs (avoid_cpu). All measured in session 43's
 * one-offs and on docs/bench/contention.md (figures in docs/arch/runtime.md). Chunk functions may be left at any
 * point: they take no lock and allocate nothing (their entry functions do, around hf_run).
 * A wait that still runs longer than ``stall_us`` (HF_STALL_US; a helper that had claimed a chunk but not yet
 * published it, or taking over switched off) is a stall, and after one the caller runs the next jobs alone
 * (``solo``) for a backoff period: HF_SOLO_FIRST_US after an isolated stall, doubled (up to HF_SOLO_MAX_US) when
 * the helpers stall again within HF_PROBE_US, or within the last period's length, of their first job after it
 * (not of its end: a process that made no pooled call meanwhile probes late), which is what a neighbour that keeps
 * a core busy does (the window is that long because some stalls came only after a while; why, not traced).
 * Without this, two threads took 1.13-1.19x one thread's decode time beside a busy process (session 42's one-offs,
 * docs/arch/runtime.md), so running alone is the better choice there; on an idle host a rare stall (cause not
 * traced) costs one short solo period. Solo jobs run the same chunks, so the same bits. */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define HF_SPIN_US 50 /* the pool's default spin, µs (kernels.native.SPIN_US) */
#define HF_STALL_US 300          /* a longer wait for a helper's claimed chunk is a stall (kernels.native.STALL_US) */
#define HF_SOLO_FIRST_US 2000.0  /* solo period after an isolated stall */
#define HF_SOLO_MAX_US 1000000.0 /* longest solo period (helpers that keep stalling are let back in this often) */
#define HF_PROBE_US 20000.0      /* a stall this soon (or within the last solo period's length) after the helpers
                                  * are let back in doubles the next solo period */
#define HF_STEAL_US 100 /* a longer wait for a helper's claimed chunk: the caller takes the chunk over (steal) */
#define HF_ACK_US 50    /* how long a thief waits for the helper to answer its signal (see steal_chunks) */
#define HF_STOLEN (~0ull) /* pool.cur[t] of a chunk taken over from thread t */
#define HF_QUIET_PAIR_US 50000.0 /* a steal this soon after the previous one: a busy neighbour, so ... */
#define HF_QUIET_US 200000.0     /* ... for this long idle helpers do not spin (they sleep at once) */

typedef void (*hf_chunk_fn)(void *ctx, long chunk);
#define HF_MAX_HELPERS 63

static struct {
    pthread_mutex_t lock; /* held by the caller of the job in flight */
    pthread_mutex_t grow; /* held while starting helpers */
    int helpers;          /* helper threads started */
    pid_t owner;          /* process that started them (after fork() the child has none) */
    _Atomic unsigned seq; /* job number; helpers sleep on it (futex) */
    _Atomic long done;                /* chunks of the current job finished */
    _Atomic(hf_chunk_fn) fn;
    _Atomic(void *) ctx;
    _Atomic long nchunks;
    _Atomic int width;    /* helpers with an id below this may join the current job */
    _Atomic int sleepers; /* helpers asleep (or about to sleep) on seq */
    _Atomic int spin_us;  /* how long an idle helper / a waiting caller spins before sleeping / yielding */
    _Atomic int hold;     /* test hook: 1 helpers claim nothing (as if descheduled); 2 a helper holds each
                           * chunk it claims for 2 * stall_us before running it (descheduled while holding it);
                           * 3 as 2 with the thieves' signal blocked meanwhile (it lands when the hold ends) */
    _Atomic int stall_us; /* a longer wait for a claimed chunk is a stall; 0: never go solo */
    double solo_until, backoff, probe_from; /* solo state, owned by the holder of lock: jobs run alone until
                                             * solo_until; helpers were let back in at probe_from */
    _Atomic int team;     /* 1: jobs run on torch's OpenMP team instead (hf_pool_team) */
    _Atomic unsigned live; /* the job whose chunks may be claimed (0 while the next one is being set up) */
    _Atomic int regions;   /* runs of consecutive chunks, one per thread of the job (see run_chunks) */
    _Atomic unsigned long long next[HF_MAX_HELPERS + 1]; /* per run: (job << 32) | chunks of it claimed */
    _Atomic long jobs, chunks_total, chunks_by_helpers, helper_sleeps, chunks_taken_over, stalls, solo_jobs;
    /* taking over a descheduled helper's chunk (steal_chunks) */
    _Atomic int steal_us;   /* a longer wait for a claimed chunk: take it over (0: never) */
    _Atomic int steal_sig;  /* the signal that stops a helper's taken-over chunk (0: none could be installed) */
    pthread_t tid[HF_MAX_HELPERS];
    _Atomic unsigned long long cur[HF_MAX_HELPERS + 1]; /* per thread: (job << 32) | (chunk + 1) while it runs that
                                                         * chunk, HF_STOLEN once a thief took it over, else 0 */
    _Atomic unsigned want[HF_MAX_HELPERS + 1], ack[HF_MAX_HELPERS + 1]; /* per helper: a thief's token, and the
                                                                          * last token its handler answered */
    sigjmp_buf jb[HF_MAX_HELPERS + 1];                  /* per helper: where a taken-over chunk is left */
    _Atomic long steals, steals_unanswered, quiet_periods;
    _Atomic int caller_cpu; /* the CPU the caller set the current job up on (sched_getcpu) */
    _Atomic long moves;     /* times a helper found itself on the caller's CPU and moved off it (avoid_cpu) */
    double last_steal;            /* owned by the holder of lock */
    _Atomic long long quiet_until; /* µs (now_us): until then the effective spin is 0 (spin_now) */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .grow = PTHREAD_MUTEX_INITIALIZER, .spin_us = HF_SPIN_US,
          .stall_us = HF_STALL_US, .steal_us = HF_STEAL_US};
static __thread int hf_self; /* a helper's thread index (1..); 0 on every other thread */

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

/* An idle helper's spin at time t (µs): spin_us, or 0 in a quiet period (after steals in quick succession: a busy
 * neighbour shares a core with a helper, and a spinning helper burns the share of that core it gets, so it is
 * preempted more often holding a chunk; measured in docs/arch/runtime.md, session 43). A waiting caller keeps
 * spin_us before it yields: yielding at once gave its core to the neighbour (more stalls with an unpinned one). */
static inline int spin_now(double t) {
    return t < (double)atomic_load_explicit(&pool.quiet_until, memory_order_relaxed)
               ? 0 : atomic_load_explicit(&pool.spin_us, memory_order_relaxed);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Claim and run chunks of job ``job`` until none is left (or a newer job replaced it); returns how many.
 * The chunks are cut into ``regions`` runs of consecutive chunks, one per thread of the job; a thread claims
 * the chunks of its own run first, in order, then those left in the others (run ``self + 1``, ...). So while
 * every thread runs, each streams one contiguous block of the weight (chunks of a four-stream product
 * continue the same streams: four contiguous streams per thread), and the hardware prefetchers see few
 * jumps; a descheduled thread's run is taken over, also in order, by whoever runs. */
static long run_chunks(unsigned job, int self) {
    hf_chunk_fn fn = atomic_load(&pool.fn);
    void *ctx = atomic_load(&pool.ctx);
    long n = atomic_load(&pool.nchunks), ran = 0;
    int regions = atomic_load(&pool.regions);
    if (atomic_load(&pool.live) != job) return 0; /* fn, ctx, n may be the next job's: claim nothing */
    for (int j = 0; j < regions; j++) {
        int r = (self + j) % regions;
        long lo = n * r / regions, len = n * (r + 1) / regions - lo;
        unsigned long long st = atomic_load(&pool.next[r]);
        for (;;) {
            if ((unsigned)(st >> 32) != job) return ran;
            if ((long)(st & 0xffffffffu) >= len) break;
            if (!atomic_compare_exchange_weak(&pool.next[r], &st, st + 1)) continue;
            long idx = lo + (long)(st & 0xffffffffu);
            if (self != 0) { /* a helper: published while it runs, so that a waiting caller can take it over */
                unsigned long long mine = ((unsigned long long)job << 32) | (unsigned long long)(idx + 1);
                atomic_store(&pool.cur[self], mine);
                int hold = atomic_load_explicit(&pool.hold, memory_order_relaxed);
                if (hold == 2 || hold == 3) { /* test hooks: held for 2 * stall_us; 3: deaf to the thief meanwhile */
                    sigset_t ss;
                    sigemptyset(&ss);
                    if (hold == 3) sigaddset(&ss, atomic_load(&pool.steal_sig)), pthread_sigmask(SIG_BLOCK, &ss, NULL);
                    usleep(2 * (unsigned)atomic_load_explicit(&pool.stall_us, memory_order_relaxed) + 100);
                    if (hold == 3) pthread_sigmask(SIG_UNBLOCK, &ss, NULL); /* a thief's signal lands here */
                }
                fn(ctx, idx);
                if (!atomic_compare_exchange_strong(&pool.cur[self], &mine, 0)) { /* taken over: the thief counts it */
                    atomic_store(&pool.cur[self], 0);
                    st = atomic_load(&pool.next[r]);
                    continue;
                }
            } else
                fn(ctx, idx);
            ran++;
            if (r != self) atomic_fetch_add_explicit(&pool.chunks_taken_over, 1, memory_order_relaxed);
            atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
            st = atomic_load(&pool.next[r]);
        }
    }
    return ran;
}

/* A thief's signal on a helper (steal_chunks): leave a chunk that was taken over at once (back to helper_main);
 * otherwise (the chunk was finished, or the signal came to another thread) only answer. */
static void steal_handler(int sig) {
    (void)sig;
    int self = hf_self, err = errno;
    if (self <= 0) return;
    unsigned tok = atomic_load(&pool.want[self]);
    unsigned long long c = atomic_load(&pool.cur[self]);
    if (c == HF_STOLEN) atomic_store(&pool.cur[self], 0);
    atomic_store(&pool.ack[self], tok);
    errno = err;
    if (c == HF_STOLEN) siglongjmp(pool.jb[self], 1);
}

/* A helper that finds itself on the caller's CPU ``cpu`` competes with the caller for that core: a busy neighbour
 * on the other core leaves the scheduler no idle CPU to wake it on, so it often woke next to the caller (13-37% of
 * its joins in a one-off with a pinned neighbour) and took the caller's time. It moves to the process's other CPUs
 * instead (the main thread's set without ``cpu``: taken afresh each time, so a caller that wanders does not shrink
 * a helper's set move by move), so it takes its share from the neighbour. Nothing moves where only one CPU is
 * allowed. Returns 1 when it moved. */
static int avoid_cpu(int cpu) {
    cpu_set_t set;
    if (cpu < 0 || cpu >= CPU_SETSIZE || sched_getaffinity(getpid(), sizeof set, &set) != 0) return 0;
    if (!CPU_ISSET(cpu, &set) || CPU_COUNT(&set) < 2) return 0;
    CPU_CLR(cpu, &set);
    return sched_setaffinity(0, sizeof set, &set) == 0;
}

static void *helper_main(void *arg) {
    int id = (int)(intptr_t)arg;
    hf_self = id + 1; /* touched here first: the handler reads it */
    int sig = atomic_load(&pool.steal_sig);
    if (sig) { /* a thread inherits its creator's mask: a blocked signal would leave a taken-over chunk running */
        sigset_t ss;
        sigemptyset(&ss);
        sigaddset(&ss, sig);
        pthread_sigmask(SIG_UNBLOCK, &ss, NULL);
    }
    volatile unsigned seen = atomic_load(&pool.seq);
    for (;;) {
        double t0 = now_us();
        int spins = 0;
        while (atomic_load_explicit(&pool.seq, memory_order_acquire) == seen) {
            cpu_relax();
            if (++spins % 64 != 0) continue;
            double t = now_us(); /* read before spin_now(t): one expression left their order unspecified */
            if (t - t0 > spin_now(t)) {
                atomic_fetch_add(&pool.sleepers, 1);
                atomic_fetch_add_explicit(&pool.helper_sleeps, 1, memory_order_relaxed);
                if (atomic_load(&pool.seq) == seen) syscall(SYS_futex, &pool.seq, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&pool.sleepers, 1);
                t0 = now_us();
            }
        }
        seen = atomic_load_explicit(&pool.seq, memory_order_acquire);
        if (id < atomic_load(&pool.width) && atomic_load(&pool.hold) != 1) {
            int cc = atomic_load(&pool.caller_cpu);
            if (sched_getcpu() == cc && avoid_cpu(cc)) atomic_fetch_add_explicit(&pool.moves, 1, memory_order_relaxed);
            if (sigsetjmp(pool.jb[id + 1], 0)) continue; /* left a chunk a thief took over: this job is done */
            long ran = run_chunks(seen, id + 1);
            if (ran) atomic_fetch_add_explicit(&pool.chunks_by_helpers, ran, memory_order_relaxed);
        }
    }
    return NULL;
}

/* The thieves' signal: a real-time signal with no handler yet (another library's is left alone), from the top;
 * 0 when there is none (then nothing is taken over). SA_NODEFER: a handler that leaves by siglongjmp leaves the
 * signal unblocked without saving the mask at every job (sigsetjmp(.., 0)). */
static int install_steal_signal(void) {
    for (int sig = SIGRTMAX - 1; sig > SIGRTMIN + 2; sig--) {
        struct sigaction old;
        if (sigaction(sig, NULL, &old) != 0 || old.sa_handler != SIG_DFL || (old.sa_flags & SA_SIGINFO)) continue;
        struct sigaction sa = {0};
        sa.sa_handler = steal_handler;
        sa.sa_flags = SA_NODEFER | SA_RESTART;
        sigemptyset(&sa.sa_mask);
        if (sigaction(sig, &sa, NULL) == 0) return sig;
    }
    return 0;
}

/* Start helpers until there are ``want`` (fewer if thread creation fails: the caller covers for them). */
static int ensure_helpers(int want) {
    if (want > HF_MAX_HELPERS) want = HF_MAX_HELPERS;
    pthread_mutex_lock(&pool.grow);
    if (pool.owner != getpid()) pool.helpers = 0, pool.owner = getpid(); /* a forked child inherits no threads */
    if (pool.helpers < want && atomic_load(&pool.steal_sig) == 0) atomic_store(&pool.steal_sig, install_steal_signal());
    while (pool.helpers < want) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        int err = pthread_create(&t, &a, helper_main, (void *)(intptr_t)pool.helpers);
        pthread_attr_destroy(&a);
        if (err) break;
        pool.tid[pool.helpers] = t;
        atomic_store(&pool.cur[pool.helpers + 1], 0);
        pool.helpers++;
    }
    int have = pool.helpers;
    pthread_mutex_unlock(&pool.grow);
    return have;
}

static void hf_run_team(hf_chunk_fn fn, void *ctx, long n, int threads);

/* Take over the chunks of job ``job`` that helpers 1..width are running (the caller has waited steal_us for them):
 * mark each one taken (pool.cur), signal its helper, and run it here. Safe because the helper runs none of that
 * chunk's code after the signal: a descheduled helper runs the handler (which leaves the chunk by siglongjmp)
 * before any code of its own when it is scheduled again, and a running one answers within microseconds (the wait
 * below; if it had already finished the chunk, its own check sees the mark and it does not count it). The caller
 * then writes the chunk's outputs itself: the same chunk, so the same bits. Returns the chunks taken over. */
static long steal_chunks(unsigned job, hf_chunk_fn fn, void *ctx, int width) {
    static _Atomic unsigned token;
    int sig = atomic_load(&pool.steal_sig);
    long got = 0;
    if (!sig) return 0;
    for (int t = 1; t <= width; t++) {
        unsigned long long c = atomic_load(&pool.cur[t]);
        if (c == 0 || c == HF_STOLEN || (unsigned)(c >> 32) != job) continue;
        struct sigaction now;
        if (sigaction(sig, NULL, &now) != 0 || now.sa_handler != steal_handler) { /* replaced since: never again */
            atomic_store(&pool.steal_sig, 0);
            return got;
        }
        if (!atomic_compare_exchange_strong(&pool.cur[t], &c, HF_STOLEN)) continue; /* it has just finished it */
        unsigned tok = atomic_fetch_add(&token, 1) + 1;
        atomic_store(&pool.want[t], tok); /* after the mark: a handler that reads tok sees the mark (or 0) */
        if (pthread_kill(pool.tid[t - 1], sig) != 0) {
            while (atomic_load(&pool.cur[t]) == HF_STOLEN) cpu_relax(); /* no signal: wait until it left the chunk */
        } else {
            double t0 = now_us();
            while (atomic_load(&pool.ack[t]) != tok && now_us() - t0 < HF_ACK_US) cpu_relax();
            if (atomic_load(&pool.ack[t]) != tok) /* descheduled: it runs the handler before anything else */
                atomic_fetch_add_explicit(&pool.steals_unanswered, 1, memory_order_relaxed);
        }
        fn(ctx, (long)(c & 0xffffffffu) - 1);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        atomic_fetch_add_explicit(&pool.steals, 1, memory_order_relaxed);
        got++;
    }
    return got;
}

/* A take-over at time t: a second one within HF_QUIET_PAIR_US (a busy neighbour) starts or extends a quiet period
 * (spin_now). Called with pool.lock held. */
static void after_steal(double t) {
    if (t - pool.last_steal < HF_QUIET_PAIR_US) {
        if (t >= (double)atomic_load(&pool.quiet_until))
            atomic_fetch_add_explicit(&pool.quiet_periods, 1, memory_order_relaxed);
        atomic_store(&pool.quiet_until, (long long)(t + HF_QUIET_US));
    }
    pool.last_steal = t;
}

/* A pooled job of n chunks is over (run with the helpers or solo): count it and let the next caller in. */
static void job_done(long n) {
    atomic_fetch_add_explicit(&pool.jobs, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&pool.chunks_total, n, memory_order_relaxed);
    pthread_mutex_unlock(&pool.lock);
}

/* Run fn(ctx, 0..n-1) on the caller and up to ``threads - 1`` helpers; returns when all chunks are done. In team
 * mode (hf_pool_team) on torch's OpenMP team instead: same chunks, so the same bits. */
static void hf_run(hf_chunk_fn fn, void *ctx, long n, int threads) {
    if (atomic_load_explicit(&pool.team, memory_order_relaxed)) {
        hf_run_team(fn, ctx, n, threads);
        return;
    }
    if (threads <= 1 || n <= 1 || pthread_mutex_trylock(&pool.lock) != 0) {
        for (long i = 0; i < n; i++) fn(ctx, i);
        return;
    }
    int stall_us = atomic_load_explicit(&pool.stall_us, memory_order_relaxed);
    if (stall_us > 0 && pool.solo_until > 0) { /* backing off after a stall */
        double t = now_us();
        if (t < pool.solo_until) {
            for (long i = 0; i < n; i++) fn(ctx, i);
            atomic_fetch_add_explicit(&pool.solo_jobs, 1, memory_order_relaxed);
            job_done(n);
            return;
        }
        pool.solo_until = 0, pool.probe_from = t; /* helpers let back in: the probe starts with this job */
    }
    int helpers = ensure_helpers(threads - 1), width = helpers < threads - 1 ? helpers : threads - 1;
    unsigned job = atomic_load(&pool.seq) + 1;
    if (job == 0) job = 1; /* 0 means "no job" in pool.live */
    int regions = width + 1 < n ? width + 1 : (int)n;
    atomic_store(&pool.live, 0); /* before fn, ctx, n change: a helper late for the last job claims nothing */
    atomic_store(&pool.fn, fn);
    atomic_store(&pool.ctx, ctx);
    atomic_store(&pool.nchunks, n);
    atomic_store(&pool.regions, regions);
    atomic_store(&pool.width, width);
    atomic_store(&pool.done, 0);
    for (int r = 0; r < regions; r++) atomic_store(&pool.next[r], (unsigned long long)job << 32);
    atomic_store(&pool.caller_cpu, sched_getcpu());
    atomic_store(&pool.live, job);
    atomic_store(&pool.seq, job);
    if (atomic_load(&pool.sleepers) > 0) syscall(SYS_futex, &pool.seq, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    run_chunks(job, 0);
    double t0 = 0;
    int spins = 0, steal_us = atomic_load_explicit(&pool.steal_us, memory_order_relaxed);
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < n) { /* chunks a helper claimed */
        cpu_relax();
        if (++spins % 64 == 0) {
            if (t0 == 0) t0 = now_us();
            else {
                double t = now_us(), w = t - t0;
                if (steal_us > 0 && w > steal_us && steal_chunks(job, fn, ctx, width) > 0) {
                    after_steal(t);
                    t0 = 0; /* a stall only if the wait goes on after this */
                    continue;
                }
                if (w > atomic_load_explicit(&pool.spin_us, memory_order_relaxed)) sched_yield();
            }
        }
    }
    if (t0 > 0 && stall_us > 0) { /* waited at least 64 pauses: was it a stall? */
        double t1 = now_us();
        if (t1 - t0 > stall_us) {
            atomic_fetch_add_explicit(&pool.stalls, 1, memory_order_relaxed);
            double window = pool.backoff > HF_PROBE_US ? pool.backoff : HF_PROBE_US;
            int again = pool.backoff > 0 && t0 - pool.probe_from < window;
            pool.backoff = !again ? HF_SOLO_FIRST_US : pool.backoff * 2 < HF_SOLO_MAX_US ? pool.backoff * 2
                                                                                          : HF_SOLO_MAX_US;
            pool.solo_until = t1 + pool.backoff;
        }
    }
    job_done(n);
}

/* Run fn(ctx, 0..n-1) on torch's OpenMP team (this library's libgomp is the copy torch loaded), chunks handed
 * out one at a time. For the multi-row kernels of a prefill: there the ATen/oneDNN GEMMs around them run on that
 * team, whose threads spin a while after each GEMM; a second pool woken in that window competes with them for
 * the cores (measured: a prefill attention ran about 2x its isolated time between GEMMs on the pool above). The
 * one-row decode kernels stay on the pool: there no call may wait at a barrier for a descheduled thread. */
static _Atomic int forked_child; /* set in a child of fork(): libgomp's team does not survive it (see below) */

static void hf_run_team(hf_chunk_fn fn, void *ctx, long n, int threads) {
    /* in a forked child a region of two threads or more hangs once the parent had started the team, so the
     * child runs every chunk itself: the same chunks, so the same bits */
    if (threads <= 1 || n <= 1 || atomic_load_explicit(&forked_child, memory_order_relaxed)) {
        if (omp_in_parallel()) { /* inside a caller's parallel region: a team of one, so a chunk function that
                                  * indexes per-thread scratch by omp_get_thread_num() (hf_gemm_q4a) reads 0 */
#pragma omp parallel num_threads(1)
            for (long i = 0; i < n; i++) fn(ctx, i);
            return;
        }
        for (long i = 0; i < n; i++) fn(ctx, i);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (long i = 0; i < n; i++) fn(ctx, i);
}

/* Read back the pool: out[0..16] = helpers started, spin_us, jobs run by the pool, their chunks, chunks run
 * by helpers, helper sleeps (futex waits), chunks a thread ran from another thread's run (taken over),
 * whether jobs run on the OpenMP team (hf_pool_team), stall_us, stalls, jobs the caller ran alone (solo)
 * because the pool was backing off after a stall, steal_us, chunks taken over from a helper (steal_chunks), the
 * thieves' signal (0: none), the steals whose helper had not answered within HF_ACK_US, the quiet periods
 * begun (spin_now), and the helpers' moves off the caller's CPU (avoid_cpu). */
void hf_pool_info(long *out) {
    out[0] = pool.owner == getpid() ? pool.helpers : 0;
    out[1] = atomic_load(&pool.spin_us);
    out[2] = atomic_load(&pool.jobs);
    out[3] = atomic_load(&pool.chunks_total);
    out[4] = atomic_load(&pool.chunks_by_helpers);
    out[5] = atomic_load(&pool.helper_sleeps);
    out[6] = atomic_load(&pool.chunks_taken_over);
    out[7] = atomic_load(&pool.team);
    out[8] = atomic_load(&pool.stall_us);
    out[9] = atomic_load(&pool.stalls);
    out[10] = atomic_load(&pool.solo_jobs);
    out[11] = atomic_load(&pool.steal_us);
    out[12] = atomic_load(&pool.steals);
    out[13] = atomic_load(&pool.steal_sig);
    out[14] = atomic_load(&pool.steals_unanswered);
    out[15] = atomic_load(&pool.quiet_periods);
    out[16] = atomic_load(&pool.moves);
}

/* team = 1: the pool's jobs run on torch's OpenMP team (hf_run_team) until team = 0. */
void hf_pool_team(int team) { atomic_store_explicit(&pool.team, team != 0, memory_order_relaxed); }

/* A forked child never runs the pool's jobs on the OpenMP team: libgomp's team does not survive fork() (a
 * two-thread region in the child hangs), while the pool starts the child's own helpers. The child has only the
 * forking thread, so the pool's locks start free there: a copy held by another parent thread at fork() would
 * otherwise stay held (every job inline, hf_pool_config and ensure_helpers blocked for good). */
static void pool_team_off_in_child(void) {
    atomic_store(&pool.team, 0);
    atomic_store(&forked_child, 1);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_mutex_init(&pool.grow, NULL);
}
__attribute__((constructor)) static void pool_register_fork_handler(void) {
    pthread_atfork(NULL, NULL, pool_team_off_in_child);
}

/* Set the spin time (µs, >= 0), the stall threshold (µs; 0: never go solo), the wait after which a claimed chunk
 * is taken over (µs; 0: never), and the test hook ``hold`` (see the pool); ends any solo or quiet period. */
void hf_pool_config(int spin_us, int hold, int stall_us, int steal_us) {
    pthread_mutex_lock(&pool.lock);
    atomic_store(&pool.spin_us, spin_us < 0 ? 0 : spin_us);
    atomic_store(&pool.stall_us, stall_us < 0 ? 0 : stall_us);
    atomic_store(&pool.steal_us, steal_us < 0 ? 0 : steal_us);
    atomic_store(&pool.hold, hold);
    pool.solo_until = pool.backoff = pool.probe_from = pool.last_steal = 0;
    atomic_store(&pool.quiet_until, 0);
    pthread_mutex_unlock(&pool.lock);
}

static inline float dot(const float *restrict a, const float *restrict b, long k) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (long i = 0; i < k; i++) s += a[i] * b[i];
    return s;
}

/* Four dot products sharing x: four weight rows streamed at once (the one-row products' inner loop).
 * Summation order, the same on every path (AVX-512, AVX2, plain C), so a result does not depend on the
 * build: element i of a row goes to lane i % 16 of that row's 16 partial sums (a * x, then +; no FMA), in
 * order of i (the last, partial block padded with 0 * 0); the 16 lanes are then added by halves (lane l +=
 * lane l + h for h = 8, 4, 2, 1). The halving is a few instructions per row; a lane-by-lane sum (what the
 * compiler made of an ``omp simd`` reduction) was a long dependent chain per row that slowed the stream. */
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
/* The lanes of a 16-wide step with ``left`` elements still to go (all 16 when left >= 16). */
static inline __mmask16 mask16(long left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }
#endif
#define HF_LANES 16
/* Software prefetch distance of the one-row products' weight streams, bytes ahead of the read (into L1: the
 * hardware prefetchers stop at 4 KiB pages, and four streams per thread keep them from running far enough
 * ahead). How it was chosen: docs/arch/runtime.md, "Weight-stream prefetch". 0: none. */
#ifndef HF_PF_BYTES
#define HF_PF_BYTES 2048
#endif
/* The fp32 streams' own distance (dot4, kn_partial; the bf16 and int8 ones keep HF_PF_BYTES): on some CPUs the fp32
 * and bf16 products are fastest at different distances (native.host_defines; docs/arch/runtime.md). Default:
 * HF_PF_BYTES. */
#ifndef HF_PF_BYTES_F32
#define HF_PF_BYTES_F32 HF_PF_BYTES
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
/* A prefetch d bytes past p into L1; none for d = 0 (a constant: the compiler drops the branch). */
#define HF_PREFETCH_AT(p, d) ((d) > 0 ? _mm_prefetch((const char *)(p) + (d), _MM_HINT_T0) : (void)0)
#else
#define HF_PREFETCH_AT(p, d) ((void)0)
#endif
#define HF_PREFETCH(p) HF_PREFETCH_AT(p, HF_PF_BYTES)
#define HF_PREFETCH_F32(p) HF_PREFETCH_AT(p, HF_PF_BYTES_F32)

#if defined(__AVX512F__) || defined(__AVX2__)
static inline float hsum_halves128(__m128 v) { /* lanes 0..3 of a sum already halved from 16 to 4 */
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));         /* l += l + 2 */
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v))); /* l += l + 1 */
}
#endif
#if defined(__AVX512F__)
static inline float hsum16(__m512 v) {
    __m256 lo = _mm512_castps512_ps256(v), hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 h8 = _mm256_add_ps(lo, hi); /* l += l + 8 */
    return hsum_halves128(_mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1))); /* l += l + 4 */
}
#elif defined(__AVX2__)
static inline float hsum16(__m256 lo, __m256 hi) {
    __m256 h8 = _mm256_add_ps(lo, hi);
    return hsum_halves128(_mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1)));
}
#endif

static void dot4(const float *restrict a0, const float *restrict a1, const float *restrict a2,
                 const float *restrict a3, const float *restrict b, long k, float *out) {
    long i = 0;
#if defined(__AVX512F__)
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (; i + HF_LANES <= k; i += HF_LANES) {
        __m512 xv = _mm512_loadu_ps(b + i);
        HF_PREFETCH_F32(a0 + i), HF_PREFETCH_F32(a1 + i), HF_PREFETCH_F32(a2 + i), HF_PREFETCH_F32(a3 + i);
        s0 = _mm512_add_ps(s0, _mm512_mul_ps(_mm512_loadu_ps(a0 + i), xv));
        s1 = _mm512_add_ps(s1, _mm512_mul_ps(_mm512_loadu_ps(a1 + i), xv));
        s2 = _mm512_add_ps(s2, _mm512_mul_ps(_mm512_loadu_ps(a2 + i), xv));
        s3 = _mm512_add_ps(s3, _mm512_mul_ps(_mm512_loadu_ps(a3 + i), xv));
    }
    if (i < k) { /* masked lanes load 0: they add 0 * 0, as the plain C path does */
        __mmask16 m = (__mmask16)((1u << (k - i)) - 1);
        __m512 xv = _mm512_maskz_loadu_ps(m, b + i);
        s0 = _mm512_add_ps(s0, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, a0 + i), xv));
        s1 = _mm512_add_ps(s1, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, a1 + i), xv));
        s2 = _mm512_add_ps(s2, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, a2 + i), xv));
        s3 = _mm512_add_ps(s3, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, a3 + i), xv));
    }
    out[0] = hsum16(s0), out[1] = hsum16(s1), out[2] = hsum16(s2), out[3] = hsum16(s3);
#else
    const float *rows[4] = {a0, a1, a2, a3};
#if defined(__AVX2__)
    __m256 lo[4], hi[4];
    for (int r = 0; r < 4; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (; i + HF_LANES <= k; i += HF_LANES) {
        __m256 xl = _mm256_loadu_ps(b + i), xh = _mm256_loadu_ps(b + i + 8);
        for (int r = 0; r < 4; r++) {
            lo[r] = _mm256_add_ps(lo[r], _mm256_mul_ps(_mm256_loadu_ps(rows[r] + i), xl));
            hi[r] = _mm256_add_ps(hi[r], _mm256_mul_ps(_mm256_loadu_ps(rows[r] + i + 8), xh));
        }
    }
    float s[4][HF_LANES];
    for (int r = 0; r < 4; r++) _mm256_storeu_ps(s[r], lo[r]), _mm256_storeu_ps(s[r] + 8, hi[r]);
#else
    float s[4][HF_LANES] = {{0.f}};
    for (; i + HF_LANES <= k; i += HF_LANES)
        for (int r = 0; r < 4; r++)
            for (int l = 0; l < HF_LANES; l++) s[r][l] += rows[r][i + l] * b[i + l];
#endif
    if (i < k)
        for (int r = 0; r < 4; r++)
            for (int l = 0; l < HF_LANES; l++) s[r][l] += i + l < k ? rows[r][i + l] * b[i + l] : 0.f * 0.f;
    for (int r = 0; r < 4; r++) {
        for (int h = HF_LANES / 2; h >= 1; h /= 2)
            for (int l = 0; l < h; l++) s[r][l] += s[r][l + h];
        out[r] = s[r][0];
    }
#endif
}

/* One row in dot4's order (the n % 4 tail rows of a four-stream product). */
static float dot1(const float *a, const float *b, long k) {
    float o[4];
    dot4(a, a, a, a, b, k, o);
    return o[0];
}

/* act(v) for ACT_RELU, ACT_GELU (erf), ACT_GELU_TANH, ACT_SILU: the formulas of ATen's kernels (results equal
 * to rounding: libm's erff/tanhf/expf are not ATen's vectorized ones). */
enum { ACT_NONE = 0, ACT_RELU = 1, ACT_GELU = 2, ACT_GELU_TANH = 3, ACT_SILU = 4 };

static float act_of(float v, int act) {
    switch (act) {
    case ACT_RELU: return v <= 0.f ? 0.f : v; /* NaN stays NaN, as in torch.relu */
    case ACT_GELU: return v * 0.5f * (1.f + erff(v * (float)M_SQRT1_2));
    case ACT_GELU_TANH: {
        const float beta = (float)(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
        float cube = v * v * v;
        float inner = beta * (v + kappa * cube);
        return 0.5f * v * (1.f + tanhf(inner));
    }
    case ACT_SILU: return v / (1.f + expf(-v));
    default: return v;
    }
}

/* Chunk sizes: ~128 KiB of weight per chunk (a few µs of streaming: small enough that a descheduled helper
 * leaves little behind, large enough that claiming one is noise), rows a multiple of four (four streams). */
#ifndef HF_CHUNK_BYTES
#define HF_CHUNK_BYTES 131072L
#endif
#define HF_COLS 256 /* columns per chunk of a split-K reduction */

/* Rows per stream of one chunk (a chunk reads four streams of this many rows). */
static long rows_per_chunk(long row_bytes) {
    long r = HF_CHUNK_BYTES / 4 / (row_bytes > 0 ? row_bytes : 1);
    return r < 1 ? 1 : r;
}

/* Chunks of a four-stream product over ``n`` rows: the rows are four quarters of ``n / 4`` (plus a tail of
 * n % 4 rows, one more chunk); chunk c reads rows [c*rows, (c+1)*rows) of every quarter. Consecutive chunks
 * continue the same four streams, so one thread running them in order streams each quarter start to end
 * (as one contiguous block would), and the chunking costs no prefetch restarts. */
static long four_stream_chunks(long n, long rows) {
    long quarter = n / 4;
    return (quarter + rows - 1) / rows + (n % 4 ? 1 : 0);
}

typedef struct {
    const float *w, *x, *bias;
    float *y, *part;
    long n, k, rows;
    int act, chunks;
    const float *res; /* a residual added after the activation (the graph's add after the product), or NULL */
} gemv_ctx;

/* The residual add after a product's element: y = v + res[r], rounded as ATen's add after it (one fp32 add). */
static inline float with_res(float v, const float *res, long r) { return res ? v + res[r] : v; }

/* Chunk c of y = act(W x + b), W [N, K]: rows [c*rows, (c+1)*rows) of each quarter of W, read as four
 * streams (one per quarter): one stream per core leaves memory bandwidth unused (measured: docs/arch/runtime.md).
 * The last chunk holds the n % 4 tail rows. */
static void nk_chunk(void *p, long c) {
    const gemv_ctx *a = p;
    long n = a->n, k = a->k, q = n / 4, i0 = c * a->rows, i1 = i0 + a->rows < q ? i0 + a->rows : q;
    const float *w = a->w, *x = a->x;
    float *y = a->y, o[4];
    if (i0 >= q) { /* the tail */
        for (long r = 4 * q; r < n; r++) {
            float v = dot1(w + r * k, x, k);
            y[r] = with_res(act_of(a->bias ? v + a->bias[r] : v, a->act), a->res, r);
        }
        return;
    }
    for (long i = i0; i < i1; i++) {
        dot4(w + i * k, w + (i + q) * k, w + (i + 2 * q) * k, w + (i + 3 * q) * k, x, k, o);
        for (int j = 0; j < 4; j++) {
            long r = i + j * q;
            y[r] = with_res(act_of(a->bias ? o[j] + a->bias[r] : o[j], a->act), a->res, r);
        }
    }
}

static void gemv_nk_act(const float *w, const float *x, const float *bias, float *y, long n, long k, int act,
                        int threads, const float *res) {
    gemv_ctx a = {w, x, bias, y, 0, n, k, rows_per_chunk(k * (long)sizeof(float)), act, 0, res};
    hf_run(nk_chunk, &a, four_stream_chunks(n, a.rows), clamp_threads(threads));
}

/* y[n] = sum_k w[n, k] x[k] (+ bias[n]); w is [N, K] row-major (F.linear layout), in row chunks. */
void hf_gemv_nk(const float *w, const float *x, const float *bias, float *y, long n, long k, int threads) {
    gemv_nk_act(w, x, bias, y, n, k, ACT_NONE, threads, 0);
}

/* Several one-row products of one x, one pool call: y_j = W_j x (+ b_j) for j < m (m <= HF_MULTI_MAX), each
 * W_j [N_j, K] in its own buffer, e.g. a layer's q, k and v projections. Why: each pool call costs a few µs
 * beyond its stream (handing chunks to the helpers, restarting the prefetch streams, waiting for the last chunk);
 * one call over the stacked rows pays that once (measured: docs/arch/runtime.md, hf_gemv_nk_multi; this kernel
 * reads the same chunks from three buffers).
 * The rows of all W_j are read as one [sum N_j, K] matrix in the four-stream chunks of hf_gemv_nk, and every
 * row is summed by dot4 exactly as hf_gemv_nk sums it: each y_j is bit-equal to its own hf_gemv_nk call. */
#define HF_MULTI_MAX 4
typedef struct {
    const float *w[HF_MULTI_MAX], *bias[HF_MULTI_MAX], *x;
    float *y[HF_MULTI_MAX];
    long off[HF_MULTI_MAX + 1]; /* row r of the stack is row r - off[j] of W_j for off[j] <= r < off[j + 1] */
    long n, k, rows;
} multi_ctx;

static inline int multi_member(const multi_ctx *a, long r) {
    int j = 0;
    while (r >= a->off[j + 1]) j++;
    return j;
}

static inline const float *multi_row(const multi_ctx *a, long r) {
    int j = multi_member(a, r);
    return a->w[j] + (r - a->off[j]) * a->k;
}

static inline void multi_store(const multi_ctx *a, long r, float v) {
    int j = multi_member(a, r);
    long i = r - a->off[j];
    a->y[j][i] = a->bias[j] ? v + a->bias[j][i] : v;
}

static void multi_chunk(void *p, long c) {
    const multi_ctx *a = p;
    long n = a->n, k = a->k, q = n / 4, i0 = c * a->rows, i1 = i0 + a->rows < q ? i0 + a->rows : q;
    float o[4];
    if (i0 >= q) { /* the tail */
        for (long r = 4 * q; r < n; r++) multi_store(a, r, dot1(multi_row(a, r), a->x, k));
        return;
    }
    for (long i = i0; i < i1; i++) {
        dot4(multi_row(a, i), multi_row(a, i + q), multi_row(a, i + 2 * q), multi_row(a, i + 3 * q), a->x, k, o);
        for (int j = 0; j < 4; j++) multi_store(a, i + j * q, o[j]);
    }
}

/* w, bias, y: arrays of m pointers (a bias may be NULL); n: the m row counts. Returns -1 (nothing done) when m is
 * not in 1..HF_MULTI_MAX, else 0. */
int hf_gemv_nk_multi(int m, const float *const *w, const float *const *bias, float *const *y, const long *n,
                     const float *x, long k, int threads) {
    if (m < 1 || m > HF_MULTI_MAX) return -1;
    multi_ctx a = {.x = x, .k = k, .rows = rows_per_chunk(k * (long)sizeof(float))};
    a.off[0] = 0;
    for (int j = 0; j < HF_MULTI_MAX; j++) {
        a.w[j] = j < m ? w[j] : 0, a.bias[j] = j < m ? bias[j] : 0, a.y[j] = j < m ? y[j] : 0;
        a.off[j + 1] = a.off[j] + (j < m ? n[j] : 0);
    }
    a.n = a.off[m];
    for (int j = m; j < HF_MULTI_MAX; j++) a.off[j + 1] = LONG_MAX; /* multi_member never passes member m - 1 */
    hf_run(multi_chunk, &a, four_stream_chunks(a.n, a.rows), clamp_threads(threads));
    return 0;
}

#if defined(__AVX512F__)
/* e^x for x <= 0 (0 below -87.3, where fp32 would underflow to a denormal): Cephes' expf polynomial. */
static inline __m512 pa_exp16(__m512 x) {
    __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}
#endif

#if defined(__AVX512F__)
/* The tanh GELU of 16 values, 0.5·v·(1 + tanh(u)), u = √(2/π)·(v + 0.044715·v³) as act_of computes it, with
 * 1 + tanh(u) = 2/(1 + e) for u >= 0 and 2e/(1 + e) below, e = exp(−2|u|) on pa_exp16 (~1 ulp): no cancellation
 * where tanh(u) nears −1, so within a few ulp of the exact value (libm's 1 + tanhf(u) there is off by up to an
 * ulp of 1). Why: the scalar tanhf of every output of a 3072-wide MLP product cost about a tenth of its weight
 * stream (docs/arch/hardware-cost.md, native activation). */
static inline __m512 gelu_tanh16(__m512 v) {
    const __m512 beta = _mm512_set1_ps((float)(M_SQRT2 * M_2_SQRTPI * 0.5)), kappa = _mm512_set1_ps(0.044715f);
    const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f);
    __m512 cube = _mm512_mul_ps(_mm512_mul_ps(v, v), v);
    __m512 u = _mm512_mul_ps(beta, _mm512_add_ps(v, _mm512_mul_ps(kappa, cube)));
    __m512 e = pa_exp16(_mm512_mul_ps(_mm512_set1_ps(-2.f), _mm512_abs_ps(u)));
    __mmask16 neg = _mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 onept = _mm512_div_ps(_mm512_mask_mul_ps(two, neg, two, e), _mm512_add_ps(one, e));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), v), onept);
}
#endif

#if defined(__AVX512F__)
/* act(v) of 16 values for the activations a multi-row product's epilogue applies (hf_epilogue_act): ReLU (NaN
 * stays NaN), the tanh GELU (gelu_tanh16) and SiLU, v / (1 + exp(-v)) as v·s / (1 + e), e = exp(-|v|), s = 1 for
 * v >= 0 and e below (pa_exp16 takes only arguments <= 0). */
static inline __m512 act16(__m512 v, int act) {
    if (act == ACT_RELU)
        return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LE_OQ), _mm512_setzero_ps());
    if (act == ACT_GELU_TANH) return gelu_tanh16(v);
    if (act == ACT_SILU) {
        __m512 e = pa_exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(v)));
        __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
        return _mm512_div_ps(_mm512_mask_mul_ps(v, neg, v, e), _mm512_add_ps(_mm512_set1_ps(1.f), e));
    }
    return v;
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define HF_ACT8 1
/* pa_exp16 on 8 lanes with AVX2's instructions: the same operations in the same order (round to nearest even,
 * the two-part reduction, the polynomial), and 2^n applied as a multiply by the float whose exponent field is
 * n + 127 (n >= -126 here, so that float is normal and the product is rounded once, as scalef's). */
static inline __m256 pa_exp8(__m256 x) {
    __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline __m256 abs8(__m256 v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }

/* act16 on 8 lanes: the same formulas and operations in the same order (ReLU, the tanh GELU, SiLU). */
static inline __m256 act8(__m256 v, int act) {
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.f);
    if (act == ACT_RELU) return _mm256_blendv_ps(v, zero, _mm256_cmp_ps(v, zero, _CMP_LE_OQ));
    if (act == ACT_GELU_TANH) {
        const __m256 beta = _mm256_set1_ps((float)(M_SQRT2 * M_2_SQRTPI * 0.5)), kappa = _mm256_set1_ps(0.044715f);
        const __m256 two = _mm256_set1_ps(2.f);
        __m256 cube = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
        __m256 u = _mm256_mul_ps(beta, _mm256_add_ps(v, _mm256_mul_ps(kappa, cube)));
        __m256 e = pa_exp8(_mm256_mul_ps(_mm256_set1_ps(-2.f), abs8(u)));
        __m256 neg = _mm256_cmp_ps(u, zero, _CMP_LT_OQ);
        __m256 onept = _mm256_div_ps(_mm256_blendv_ps(two, _mm256_mul_ps(two, e), neg), _mm256_add_ps(one, e));
        return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), v), onept);
    }
    if (act == ACT_SILU) {
        __m256 e = pa_exp8(_mm256_sub_ps(zero, abs8(v)));
        __m256 neg = _mm256_cmp_ps(v, zero, _CMP_LT_OQ);
        return _mm256_div_ps(_mm256_blendv_ps(v, _mm256_mul_ps(v, e), neg), _mm256_add_ps(one, e));
    }
    return v;
}

/* y[0..n) = act8(y) (* mul) (+ res), n <= 8 (mul, res NULL: none), 8 lanes at a time: the tail through a
 * zero-padded copy, so every value takes the same operations as a full vector's. */
static inline void act8_store(float *y, const float *o, long n, int act, const float *mul, const float *res) {
    if (n == 8) {
        __m256 v = act8(_mm256_loadu_ps(o), act);
        if (mul) v = _mm256_mul_ps(v, _mm256_loadu_ps(mul));
        if (res) v = _mm256_add_ps(v, _mm256_loadu_ps(res));
        _mm256_storeu_ps(y, v);
        return;
    }
    float t[8] = {0.f}, m8[8] = {0.f}, r8[8] = {0.f};
    for (long c = 0; c < n; c++) t[c] = o[c], m8[c] = mul ? mul[c] : 0.f, r8[c] = res ? res[c] : 0.f;
    act8_store(t, t, 8, act, mul ? m8 : 0, res ? r8 : 0);
    for (long c = 0; c < n; c++) y[c] = t[c];
}
#endif

/* Whether a multi-row product's epilogue (hf_gemm_panel, hf_gemm_amx_bf16) applies ``act`` itself: the
 * activations act16 (act8 on AVX2) has, where the build has AVX-512 or AVX2 with FMA (the others stay a separate
 * pass after the product). */
int hf_epilogue_act(int act) {
#if defined(__AVX512F__) || defined(HF_ACT8)
    return act == ACT_NONE || act == ACT_RELU || act == ACT_GELU_TANH || act == ACT_SILU;
#else
    return act == ACT_NONE;
#endif
}

/* y = act(y) (* mul) in place over n fp32 values (mul NULL: none), 16 at a time with act16 (8 with act8): the
 * activation (and a gated MLP's gate × up) after a product whose kernel has no epilogue (MKL's packed sgemm, or
 * oneDNN's plain product where pick chose ``dnnact``). Why: ATen's in-place
 * tanh GELU over an MLP's product output cost more than the time MKL's product saved over oneDNN's (which fuses
 * it as a post-op). Returns -2 (nothing done) for an act the epilogue does not have (hf_epilogue_act), else 0. */
typedef struct {
    float *y;
    const float *mul;
    long n;
    int act;
} actip_ctx;
#define ACTIP_CHUNK 16384

static void actip_chunk(void *p, long c) {
    const actip_ctx *a = p;
    long i0 = c * ACTIP_CHUNK, i1 = i0 + ACTIP_CHUNK < a->n ? i0 + ACTIP_CHUNK : a->n;
#if defined(__AVX512F__)
    for (long i = i0; i < i1; i += 16) {
        __mmask16 mk = mask16(i1 - i);
        __m512 v = act16(_mm512_maskz_loadu_ps(mk, a->y + i), a->act);
        if (a->mul) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mk, a->mul + i));
        _mm512_mask_storeu_ps(a->y + i, mk, v);
    }
#elif defined(HF_ACT8)
    for (long i = i0; i < i1; i += 8)
        act8_store(a->y + i, a->y + i, i1 - i < 8 ? i1 - i : 8, a->act, a->mul ? a->mul + i : 0, 0);
#else
    for (long i = i0; i < i1; i++) a->y[i] = a->mul ? act_of(a->y[i], a->act) * a->mul[i] : act_of(a->y[i], a->act);
#endif
}

int hf_act_inplace(float *y, const float *mul, long n, int act, int threads) {
    if (!hf_epilogue_act(act)) return -2;
    actip_ctx a = {y, mul, n, act};
    long chunks = (n + ACTIP_CHUNK - 1) / ACTIP_CHUNK;
    hf_run_team(actip_chunk, &a, chunks, n >= 4 * ACTIP_CHUNK ? clamp_threads(threads) : 1);
    return 0;
}

/* Split-K part c of C: rows [c*r, (c+1)*r) of each quarter of W [K, N] (r = ceil((K/4) / C); four streams,
 * one per quarter, so consecutive parts continue the same streams), plus the K % 4 tail rows in the last part,
 * into row c of part. */
static void kn_partial(void *p, long c) {
    const gemv_ctx *a = p;
    long n = a->n, q = a->k / 4, r = (q + a->chunks - 1) / a->chunks;
    long i0 = c * r < q ? c * r : q, i1 = i0 + r < q ? i0 + r : q;
    const float *w = a->w, *x = a->x;
    float *restrict acc = a->part + (size_t)c * n;
    memset(acc, 0, (size_t)n * sizeof(float));
    for (long i = i0; i < i1; i++) {
        const float x0 = x[i], x1 = x[i + q], x2 = x[i + 2 * q], x3 = x[i + 3 * q];
        const float *restrict w0 = w + i * n, *restrict w1 = w0 + q * n;
        const float *restrict w2 = w1 + q * n, *restrict w3 = w2 + q * n;
        long j = 0;
#if defined(__AVX512F__) /* the loop below by hand (same roundings): the compiler's version was slower */
        const __m512 v0 = _mm512_set1_ps(x0), v1 = _mm512_set1_ps(x1), v2 = _mm512_set1_ps(x2), v3 = _mm512_set1_ps(x3);
        for (; j + HF_LANES <= n; j += HF_LANES) {
            HF_PREFETCH_F32(w0 + j), HF_PREFETCH_F32(w1 + j), HF_PREFETCH_F32(w2 + j), HF_PREFETCH_F32(w3 + j);
            __m512 s01 = _mm512_add_ps(_mm512_mul_ps(v0, _mm512_loadu_ps(w0 + j)),
                                       _mm512_mul_ps(v1, _mm512_loadu_ps(w1 + j)));
            __m512 s23 = _mm512_add_ps(_mm512_mul_ps(v2, _mm512_loadu_ps(w2 + j)),
                                       _mm512_mul_ps(v3, _mm512_loadu_ps(w3 + j)));
            _mm512_storeu_ps(acc + j, _mm512_add_ps(_mm512_loadu_ps(acc + j), _mm512_add_ps(s01, s23)));
        }
#endif
#pragma omp simd
        for (long jj = j; jj < n; jj++) acc[jj] += (x0 * w0[jj] + x1 * w1[jj]) + (x2 * w2[jj] + x3 * w3[jj]);
    }
    if (c == a->chunks - 1)
        for (long i = 4 * q; i < a->k; i++) {
            const float xi = x[i];
            const float *restrict wr = w + i * n;
#pragma omp simd
            for (long j = 0; j < n; j++) acc[j] += xi * wr[j];
        }
}

/* Columns [c*HF_COLS, ...) of the sum of the parts, in part order, then bias and activation. */
static void kn_reduce(void *p, long c) {
    const gemv_ctx *a = p;
    long n = a->n, j0 = c * HF_COLS, j1 = j0 + HF_COLS < n ? j0 + HF_COLS : n;
    float s[HF_COLS]; /* the sums in a local block: y may be the residual's own memory (read before written) */
    for (long j = j0; j < j1; j++) s[j - j0] = a->part[j];
    for (int cc = 1; cc < a->chunks; cc++) { /* part by part: vectorized along the columns, same order per column */
        const float *restrict pc = a->part + (size_t)cc * n;
#pragma omp simd
        for (long j = j0; j < j1; j++) s[j - j0] += pc[j];
    }
    long j = j0;
#if defined(__AVX512F__)
    if (a->act == ACT_GELU_TANH && !a->res) /* 16 columns at a time (the scalar loop below for the rest) */
        for (; j + 16 <= j1; j += 16) {
            __m512 v = _mm512_loadu_ps(s + (j - j0));
            if (a->bias) v = _mm512_add_ps(v, _mm512_loadu_ps(a->bias + j));
            _mm512_storeu_ps(a->y + j, gelu_tanh16(v));
        }
#elif defined(HF_ACT8)
    if (a->act == ACT_GELU_TANH && !a->res) /* 8 columns at a time with act8 (the scalar loop below for the rest) */
        for (; j + 8 <= j1; j += 8) {
            __m256 v = _mm256_loadu_ps(s + (j - j0));
            if (a->bias) v = _mm256_add_ps(v, _mm256_loadu_ps(a->bias + j));
            _mm256_storeu_ps(a->y + j, act8(v, ACT_GELU_TANH));
        }
#endif
    for (; j < j1; j++)
        a->y[j] = with_res(act_of(a->bias ? s[j - j0] + a->bias[j] : s[j - j0], a->act), a->res, j);
}


/* Parts of a split-K product over K: ``slots`` at most, and at least 8 rows of each quarter of K per part. */
static int kn_parts(long k, int slots) {
    long most = (k / 4 + 7) / 8;
    int chunks = slots < 1 ? 1 : slots;
    return chunks > most ? (most < 1 ? 1 : (int)most) : chunks;
}

static void gemv_kn_act(const float *w, const float *x, const float *bias, float *y, long n, long k, int act,
                        int threads, float *part, int slots, const float *res) {
    gemv_ctx a = {w, x, bias, y, part, n, k, 0, act, kn_parts(k, slots), res};
    threads = clamp_threads(threads);
    hf_run(kn_partial, &a, a.chunks, threads);
    hf_run(kn_reduce, &a, (n + HF_COLS - 1) / HF_COLS, threads);
}

/* y[n] = sum_k x[k] w[k, n] (+ bias[n]); w is [K, N] row-major (GPT-2 Conv1D / addmm layout). Split-K:
 * ``slots`` parts of K (at most; ``part`` is a [slots, N] scratch the caller owns), each streamed into its
 * own row of ``part`` by whichever thread claims it, then the partial rows are summed in part order in
 * column chunks: the parts are fixed by ``slots`` and K, so the result depends on neither the thread count
 * nor timing. */
void hf_gemv_kn(const float *w, const float *x, const float *bias, float *y, long n, long k, int threads,
                float *part, int slots) {
    gemv_kn_act(w, x, bias, y, n, k, ACT_NONE, threads, part, slots, 0);
}

/* y = x·W (+ bias) + res: a one-row product and the residual add after it as one call (hf_gemv_nk when
 * weight_t = 0, hf_gemv_kn with its ``part`` scratch when 1), the same bits as the product then ATen's add.
 * Why: after a weight stream the add's ATen dispatch runs from a cold cache (several µs), once per layer and
 * residual. ``res`` may be ``y`` itself; ``x`` must not overlap ``y``. */
void hf_gemv_res(const float *w, const float *x, const float *bias, const float *res, float *y, long n, long k,
                 int weight_t, int threads, float *part, int slots) {
    if (weight_t)
        gemv_kn_act(w, x, bias, y, n, k, ACT_NONE, threads, part, slots, res);
    else
        gemv_nk_act(w, x, bias, y, n, k, ACT_NONE, threads, res);
}

/* Reads ``n`` floats as ``threads`` x four streams, like the GEMVs above (a memory-bandwidth probe for
 * calibration: the fastest weight stream this host sustains). Returns their sum so nothing is elided. */
float hf_read_stream(const float *a, long n, int threads) {
    threads = clamp_threads(threads);
    float total = 0.f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long i0 = n * t / nt, i1 = n * (t + 1) / nt, q = (i1 - i0) / 4;
        const float *restrict a0 = a + i0, *restrict a1 = a0 + q, *restrict a2 = a1 + q, *restrict a3 = a2 + q;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (long i = 0; i < q; i++) s += (a0[i] + a1[i]) + (a2[i] + a3[i]);
        for (long i = i0 + 4 * q; i < i1; i++) s += a[i];
        total += s;
    }
    return total;
}

/* ---------------------------------------------------------------- FMA peak probe
 * The arithmetic ceiling a GEMM bound can be held against: ``threads`` threads at once (torch's OpenMP team) each
 * run ``iters`` rounds of 16 independent fused multiply-adds on registers only (no loads: nothing but the FMA
 * units), 512-bit where the build has AVX-512F, else 256-bit with FMA3 (one thread in a forked child, as
 * hf_run_team). Returns the GFLOP/s of all threads together (2 FLOPs per lane per FMA; wall time between two
 * barriers), or -1 where the build has neither. */
#if defined(__AVX512F__)
#define FMA_LANES 16
#define FMA_REG(n) "%%zmm" #n
#elif defined(__AVX2__) && defined(__FMA__)
#define FMA_LANES 8
#define FMA_REG(n) "%%ymm" #n
#endif
double hf_fma_peak(int threads, long iters) {
#ifdef FMA_LANES
    /* one thread in a forked child: a region of two threads there hangs once the parent had started the team */
    threads = atomic_load_explicit(&forked_child, memory_order_relaxed) ? 1 : clamp_threads(threads);
    double t0 = 0., t1 = 0.;
#pragma omp parallel num_threads(threads)
    {
#pragma omp barrier
#pragma omp master
        t0 = omp_get_wtime();
        long n = iters;
#define FMA4(a, b, c, d) "vfmadd231ps " FMA_REG(14) ", " FMA_REG(15) ", " FMA_REG(a) "\n\t"                     \
                         "vfmadd231ps " FMA_REG(14) ", " FMA_REG(15) ", " FMA_REG(b) "\n\t"                     \
                         "vfmadd231ps " FMA_REG(14) ", " FMA_REG(15) ", " FMA_REG(c) "\n\t"                     \
                         "vfmadd231ps " FMA_REG(14) ", " FMA_REG(15) ", " FMA_REG(d) "\n\t"
#define FMA_ZERO(a) "vxorps " FMA_REG(a) ", " FMA_REG(a) ", " FMA_REG(a) "\n\t"
        /* every register zeroed first: whatever a register held could be a denormal, which some CPUs multiply
         * slowly */
        __asm__ volatile(FMA_ZERO(0) FMA_ZERO(1) FMA_ZERO(2) FMA_ZERO(3) FMA_ZERO(4) FMA_ZERO(5) FMA_ZERO(6)
                         FMA_ZERO(7) FMA_ZERO(8) FMA_ZERO(9) FMA_ZERO(10) FMA_ZERO(11) FMA_ZERO(12) FMA_ZERO(13)
                         FMA_ZERO(14) FMA_ZERO(15)
                         "1:\n\t" FMA4(0, 1, 2, 3) FMA4(4, 5, 6, 7) FMA4(8, 9, 10, 11) FMA4(12, 13, 0, 1)
                         "dec %0\n\t"
                         "jnz 1b\n\t"
                         : "+r"(n)
                         :
                         : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
                           "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc");
#undef FMA4
#undef FMA_ZERO
#pragma omp barrier
#pragma omp master
        t1 = omp_get_wtime();
    }
    return t1 > t0 ? (double)threads * (double)iters * 16. * FMA_LANES * 2. / (t1 - t0) / 1e9 : -1.;
#else
    (void)threads, (void)iters;
    return -1.;
#endif
}

/* ---------------------------------------------------------------- decode-step row ops
 * The small per-token ops between the GEMVs. In ATen each is 3-6 kernel calls of ~3 µs dispatch on a
 * 768-float row; here each is one call. Elementwise ones are bit-equal to ATen's chains (the library is
 * built with -ffp-contract=off, so a*b + c*d is rounded like the separate ATen ops); the two norms sum
 * in their own order, so they match ATen to rounding, not bitwise. */
/* Hugging Face rotary on contiguous rows of width d: y = x*cos + rotate_half(x)*sin, with cos/sin one row
 * of width d shared by all rows (one position). rotate_half(x) = cat(-x[d/2:], x[:d/2]). */
void hf_rotary(const float *x, const float *cos_, const float *sin_, float *y, long rows, long d, int threads) {
    threads = clamp_threads(threads);
    long h = d / 2;
#pragma omp parallel for num_threads(threads) if (rows * d >= 65536) schedule(static)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        float *yr = y + r * d;
        for (long i = 0; i < h; i++) yr[i] = xr[i] * cos_[i] + (-xr[i + h]) * sin_[i];
        for (long i = h; i < d; i++) yr[i] = xr[i] * cos_[i] + xr[i - h] * sin_[i];
    }
}

/* Hugging Face rotary over many positions (prefill): x [b, h, s, d] read with strides sb, sh, ss (elements; the
 * last dim dense), e.g. a transposed view of a projection's output, read in place; cos/sin one row of width d per
 * position (row i at cos_ + i * cs; cs = 0: one row for every position); y dense [b, h, s, d]. Same roundings
 * as hf_rotary (and the ATen chain). */
void hf_rotary_pos(const float *x, const float *cos_, const float *sin_, float *y, long b, long nh, long s,
                   long d, long sb, long sh, long ss, long cs, int threads) {
    threads = clamp_threads(threads);
    long h = d / 2, rows = b * nh * s;
    /* rows walked per (batch, head) with pointer steps: an integer division per row to find its position cost
     * more than the row's arithmetic (d = 64: three divisions against 64 multiply-adds) */
#pragma omp parallel for num_threads(threads) if (rows * d >= 65536) schedule(static) collapse(2)
    for (long ib = 0; ib < b; ib++)
        for (long ih = 0; ih < nh; ih++) {
            const float *xr = x + ib * sb + ih * sh, *c = cos_, *sn = sin_;
            float *restrict yr = y + (ib * nh + ih) * s * d;
            for (long is = 0; is < s; is++, xr += ss, c += cs, sn += cs, yr += d) {
                for (long i = 0; i < h; i++) yr[i] = xr[i] * c[i] + (-xr[i + h]) * sn[i];
                for (long i = h; i < d; i++) yr[i] = xr[i] * c[i] + xr[i - h] * sn[i];
            }
        }
}

/* RMSNorm of contiguous rows: y = w * (x * (1 / sqrt(mean(x^2) + eps))); w may be NULL. */
void hf_rms_norm(const float *x, const float *w, float *y, long rows, long d, float eps, int threads) {
    threads = clamp_threads(threads);
#pragma omp parallel for num_threads(threads) if (rows * d >= 65536) schedule(static)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        float *yr = y + r * d;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (long i = 0; i < d; i++) s += xr[i] * xr[i];
        float inv = 1.f / sqrtf(s / (float)d + eps);
        if (w) {
            for (long i = 0; i < d; i++) yr[i] = w[i] * (xr[i] * inv);
        } else {
            for (long i = 0; i < d; i++) yr[i] = xr[i] * inv;
        }
    }
}

/* w8a8's per-row activation range (ops/quant.py linear_w8a8): each row of x [m, k] (k >= 2) as c + h·xn, with
 * c = (max + min) / 2, h = (max - min) / 2 and xn = clamp((x - c) / h, -1, 1) holding exactly 1 at the row's
 * first maximum and exactly -1 at its first minimum, so every row spans [-1, 1] and a per-tensor quantizer
 * (FBGEMM's dynamic one) given any set of these rows picks the one range [-1, 1]: each row is quantized by its
 * own range, with the same bits alone or among any others. A constant row: xn = 0 but xn[0] = 1, xn[1] = -1,
 * h = 0. A row with a NaN or ±Inf: the same xn, c = h = NaN (its outputs are NaN; the other rows are untouched).
 * ch [m, 2] = (c, h). */
static void row_span1(const float *xr, long k, float *yr, float *chr) {
    float mx = -INFINITY, mn = INFINITY, bad = 0.f;
#pragma omp simd reduction(max : mx) reduction(min : mn) reduction(+ : bad)
    for (long i = 0; i < k; i++) {
        mx = xr[i] > mx ? xr[i] : mx;
        mn = xr[i] < mn ? xr[i] : mn;
        bad += xr[i] - xr[i]; /* NaN for a NaN or ±Inf, else 0 */
    }
    float c = 0.5f * mx + 0.5f * mn, h = 0.5f * mx - 0.5f * mn; /* halves first: no overflow */
    if (bad != 0.f || !(h > 0.f)) {
        memset(yr, 0, (size_t)k * sizeof(float));
        yr[0] = 1.f, yr[1] = -1.f;
        chr[0] = bad != 0.f ? NAN : c, chr[1] = bad != 0.f ? NAN : 0.f;
        return;
    }
    float inv = 1.f / h;
    long imx = 0, imn = 0;
    while (xr[imx] != mx) imx++;
    while (xr[imn] != mn) imn++;
#pragma omp simd
    for (long i = 0; i < k; i++) {
        float v = (xr[i] - c) * inv;
        yr[i] = v > 1.f ? 1.f : v < -1.f ? -1.f : v;
    }
    yr[imx] = 1.f, yr[imn] = -1.f;
    chr[0] = c, chr[1] = h;
}

void hf_row_span(const float *x, long m, long k, float *xn, float *ch, int threads) {
    threads = clamp_threads(threads);
#pragma omp parallel for num_threads(threads) if (m * k >= 65536) schedule(static)
    for (long r = 0; r < m; r++) row_span1(x + r * k, k, xn + r * k, ch + 2 * r);
}

/* s[r] = the sum of row r of the int8 matrix q [n, k] (int32, exact): what w8a8's row-sum term needs of each packed
 * weight. ATen's int8 row reductions ran far below the read speed (docs/arch/quant.md). */
void hf_i8_row_sums(const int8_t *q, long n, long k, int32_t *s, int threads) {
    threads = clamp_threads(threads);
#pragma omp parallel for num_threads(threads) if (n * k >= 65536) schedule(static)
    for (long r = 0; r < n; r++) {
        const int8_t *qr = q + r * k;
        int32_t acc = 0;
#pragma omp simd reduction(+ : acc)
        for (long i = 0; i < k; i++) acc += qr[i];
        s[r] = acc;
    }
}

/* The other half of hf_row_span, in place on the product y [m, n] of its xn: y = h·y + c·wsum + b, with wsum[n]
 * the sums of the weight's rows (so c·wsum is c·1 through the weight) and b the bias (NULL: none). */
static void row_unspan1(float *yr, float c, float h, const float *wsum, const float *b, long n) {
    if (b) {
#pragma omp simd
        for (long j = 0; j < n; j++) yr[j] = (h * yr[j] + c * wsum[j]) + b[j];
    } else {
#pragma omp simd
        for (long j = 0; j < n; j++) yr[j] = h * yr[j] + c * wsum[j];
    }
}

void hf_row_unspan(float *y, const float *ch, const float *wsum, const float *b, long m, long n, int threads) {
    threads = clamp_threads(threads);
#pragma omp parallel for num_threads(threads) if (m * n >= 65536) schedule(static)
    for (long r = 0; r < m; r++) row_unspan1(y + r * n, ch[2 * r], ch[2 * r + 1], wsum, b, n);
}

/* LayerNorm of contiguous rows (biased variance, two passes): y = (x - mean) * rstd * w + b; w, b may be NULL. */
void hf_layer_norm(const float *x, const float *w, const float *b, float *y, long rows, long d, float eps,
                   int threads) {
    threads = clamp_threads(threads);
#pragma omp parallel for num_threads(threads) if (rows * d >= 65536) schedule(static)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        float *yr = y + r * d;
        float s = 0.f, q = 0.f;
#pragma omp simd reduction(+ : s)
        for (long i = 0; i < d; i++) s += xr[i];
        float mean = s / (float)d;
#pragma omp simd reduction(+ : q)
        for (long i = 0; i < d; i++) q += (xr[i] - mean) * (xr[i] - mean);
        float rstd = 1.f / sqrtf(q / (float)d + eps);
        for (long i = 0; i < d; i++) {
            float v = (xr[i] - mean) * rstd;
            if (w) v = v * w[i];
            if (b) v = v + b[i];
            yr[i] = v;
        }
    }
}

typedef struct {
    const float *q, *k_new, *v_new, *k_cache, *v_cache, *mask, *new_mask;
    float *out, *scratch, scale;
    long h, hkv, s, d;
} att_ctx;

/* Cache rows fetched ahead (software prefetch) by the decode attention, K and V side by side while the scores run:
 * into L2 HF_ATT_FAR rows ahead and into L1 HF_ATT_NEAR rows ahead (a head's first rows before its loop). Why: in a
 * decode step the cache comes from memory (the layer's weights streamed through every cache level since it was
 * last read), a head's rows are read in order but the scores read four rows at a time, a pattern the hardware
 * prefetchers follow poorly, and a weighted sum that waited for V, or a head that started cold, spent most of its
 * time waiting. The distances were chosen on calibration shapes (bench/kernel_ab.py --groups decode; the figures
 * are in docs/arch/runtime.md). Rows of bf16 are fetched at the same distances in bytes. */
#define HF_ATT_NEAR 4
#define HF_ATT_FAR 32

/* Fetch rows [r0, r1) of a head's K and V (rows of ``bytes`` bytes) into L1 (near) or L2 (far). */
#define ATT_FETCH(kc, vc, r0, r1, bytes, loc)                                                     \
    for (long fr_ = (r0); fr_ < (r1); fr_++)                                                      \
        for (long fb_ = 0; fb_ < (bytes); fb_ += 64)                                              \
            __builtin_prefetch((const char *)(kc) + fr_ * (bytes) + fb_, 0, loc),                 \
            __builtin_prefetch((const char *)(vc) + fr_ * (bytes) + fb_, 0, loc)

#if defined(__AVX512F__)
/* exp(x - mx) of 16 scores: 0 where x is -inf, NaN where x is NaN (as expf would give) */
static inline __m512 exp_scores16(__m512 x, __m512 vm, __m512 ninf) {
    __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ), pa_exp16(_mm512_sub_ps(x, vm)));
    return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}
#endif

/* pr[0..n) = exp(pr - mx), 0 where pr is -inf (a hidden position); returns their sum. pa_exp16 16 at a time where
 * the library has AVX-512 (~1 ulp, summed in 16 lanes; arguments are <= 0 as mx is the maximum), expf else. */
static float softmax_exp(float *pr, long n, float mx) {
    float z = 0.f;
    long t = 0;
#if defined(__AVX512F__)
    __m512 vz = _mm512_setzero_ps(), vm = _mm512_set1_ps(mx), ninf = _mm512_set1_ps(-INFINITY);
    for (; t + 16 <= n; t += 16) {
        __m512 x = _mm512_loadu_ps(pr + t);
        __m512 e = exp_scores16(x, vm, ninf);
        _mm512_storeu_ps(pr + t, e);
        vz = _mm512_add_ps(vz, e);
    }
    if (t < n) {
        __mmask16 m = (__mmask16)((1u << (n - t)) - 1);
        __m512 x = _mm512_mask_loadu_ps(ninf, m, pr + t);
        __m512 e = exp_scores16(x, vm, ninf);
        _mm512_mask_storeu_ps(pr + t, m, e);
        vz = _mm512_add_ps(vz, e);
        t = n;
    }
    z = hsum16(vz);
#endif
    for (; t < n; t++) {
        float e = pr[t] == -INFINITY ? 0.f : expf(pr[t] - mx); /* expf(-inf) is 0: skipped, same sum */
        pr[t] = e;
        z += e;
    }
    return z;
}

#if defined(__AVX512F__)
/* The weights w[u] = pr[u][t]·iz[u] of row t for nu heads; whether any is nonzero. */
static inline __attribute__((always_inline)) int pv_weights(float *const *pr, const float *iz, long t, int nu,
                                                           float *w) {
    int any = 0;
    for (int u = 0; u < nu; u++) w[u] = pr[u][t] * iz[u], any |= w[u] != 0.f;
    return any;
}

/* o[u][c0, c0 + 16 nv) = Σ_t (pr[u][t]·iz[u])·v_t over the cache rows vc (rows of d floats, or of d bf16 values with
 * ``bf16``) and then the new row vnew, for nu query heads that share their V rows (1 for a head of its own; up to 4
 * under GQA, then nv <= 4): each V row loaded once per column block for all of them, nu x nv accumulators (nu, nv
 * and bf16 constants at each call, so the loops unroll into registers); every column a chain in t order of a
 * product and an add (fp32) or of bf16_axpy's fused multiply-adds (bf16). A row whose weight is 0 for every head is
 * skipped (in bf16 the new row too); one whose weight is 0 for some heads only adds w·v = ±0 to their sums, which
 * leaves them as skipping it would: a sum starts at +0 and +0 + -0 is +0. */
static inline __attribute__((always_inline)) void pv_quad(float *const *o, float *const *pr, const float *iz,
                                                          const void *vc, const void *vnew, long s, long d, long c0,
                                                          int nv, int nu, int bf16) {
    __m512 acc[4][8];
    for (int u = 0; u < nu; u++)
        for (int b = 0; b < nv; b++) acc[u][b] = _mm512_setzero_ps();
    for (long t = 0; t <= s; t++) {
        float w[4];
        if (!pv_weights(pr, iz, t, nu, w) && (bf16 || t < s)) continue;
        for (int b = 0; b < nv; b++) {
            __m512 v;
            if (bf16) {
                const uint16_t *vr = (t < s ? (const uint16_t *)vc + t * d : (const uint16_t *)vnew) + c0 + 16 * b;
                v = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)vr)), 16));
                for (int u = 0; u < nu; u++) acc[u][b] = _mm512_fmadd_ps(_mm512_set1_ps(w[u]), v, acc[u][b]);
            } else {
                v = _mm512_loadu_ps((t < s ? (const float *)vc + t * d : (const float *)vnew) + c0 + 16 * b);
                for (int u = 0; u < nu; u++)
                    acc[u][b] = _mm512_add_ps(acc[u][b], _mm512_mul_ps(_mm512_set1_ps(w[u]), v));
            }
        }
    }
    for (int u = 0; u < nu; u++)
        for (int b = 0; b < nv; b++) _mm512_storeu_ps(o[u] + c0 + 16 * b, acc[u][b]);
}

/* case NU of a switch on the group's head count: pv_quad over 64-column blocks, then 16-column blocks, with NU a
 * constant so its loops unroll into registers; c0 ends past the last block */
#define PV_QUAD_CASE(NU, vnew, bf16)                                                                        \
    case NU:                                                                                                \
        for (; c0 + 64 <= d; c0 += 64) pv_quad(o, pr, iz, vc, vnew, s, d, c0, 4, NU, bf16);                \
        for (; c0 + 16 <= d; c0 += 16) pv_quad(o, pr, iz, vc, vnew, s, d, c0, 1, NU, bf16);                \
        break;
/* the switch over a group's 1-4 heads, each case with its head count a constant */
#define PV_QUAD_SWITCH(nu, vnew, bf16)                                                                      \
    switch (nu) {                                                                                           \
        PV_QUAD_CASE(1, vnew, bf16)                                                                         \
        PV_QUAD_CASE(2, vnew, bf16)                                                                         \
        PV_QUAD_CASE(3, vnew, bf16)                                                                         \
        PV_QUAD_CASE(4, vnew, bf16)                                                                         \
    }
#endif

static void att_head(void *p, long i) {
    const att_ctx *a = p;
    long s = a->s, d = a->d, j = i / (a->h / a->hkv);
    const float *qi = a->q + i * d, *kc = a->k_cache + j * s * d, *vc = a->v_cache + j * s * d;
    float *pr = a->scratch + i * (s + 1), *o = a->out + i * d, scale = a->scale;
    const float *mask = a->mask;
    float mx = -INFINITY, o4[4];
    /* Scores four cache rows at a time (dot4: four independent sums, one horizontal add each). A position the
     * mask hides (-inf: not written yet) is -inf whatever its key holds, so its key row is not read: a decode
     * step over a cache longer than the context so far reads only the written part. */
    long t = 0, rb = d * (long)sizeof(float), first = 0;
    while (first < HF_ATT_FAR && first < s && mask[first] != -INFINITY) first++;
    ATT_FETCH(kc, vc, 0, first < HF_ATT_NEAR ? first : HF_ATT_NEAR, rb, 3);
    ATT_FETCH(kc, vc, HF_ATT_NEAR, first, rb, 2);
    for (; t + 4 <= s; t += 4) {
        if (t + HF_ATT_FAR < s && mask[t + HF_ATT_FAR] != -INFINITY) ATT_FETCH(kc, vc, t + HF_ATT_FAR, t + HF_ATT_FAR + 4, rb, 2);
        if (t + HF_ATT_NEAR < s && mask[t + HF_ATT_NEAR] != -INFINITY) ATT_FETCH(kc, vc, t + HF_ATT_NEAR, t + HF_ATT_NEAR + 4, rb, 3);
        int hidden = (mask[t] == -INFINITY) + (mask[t + 1] == -INFINITY) + (mask[t + 2] == -INFINITY) +
                     (mask[t + 3] == -INFINITY);
        if (hidden == 4) {
            pr[t] = pr[t + 1] = pr[t + 2] = pr[t + 3] = -INFINITY;
            continue;
        }
        const float *k0 = kc + t * d;
        dot4(k0, k0 + d, k0 + 2 * d, k0 + 3 * d, qi, d, o4);
        for (int r = 0; r < 4; r++) {
            float v = mask[t + r] == -INFINITY ? -INFINITY : scale * o4[r] + mask[t + r];
            pr[t + r] = v;
            if (v > mx) mx = v;
        }
    }
    for (; t < s; t++) {
        float v = mask[t] == -INFINITY ? -INFINITY : scale * dot1(kc + t * d, qi, d) + mask[t];
        pr[t] = v;
        if (v > mx) mx = v;
    }
    float vn = scale * dot1(a->k_new + j * d, qi, d) + (a->new_mask ? *a->new_mask : 0.f);
    pr[s] = vn;
    if (vn > mx) mx = vn;
    float iz = 1.f / softmax_exp(pr, s + 1, mx);
    /* o = Σ_t w_t·v_t in t order (hidden rows skipped), then the new row: each output column's sum is a chain of
     * products and adds in that order, up to 128 columns at a time in registers */
    long c0 = 0;
#if defined(__AVX512F__)
    const float *vnew = a->v_new + j * d;
    float *os[1] = {o}, *prs[1] = {pr};
    for (; c0 + 128 <= d; c0 += 128) pv_quad(os, prs, &iz, vc, vnew, s, d, c0, 8, 1, 0);
    for (; c0 + 64 <= d; c0 += 64) pv_quad(os, prs, &iz, vc, vnew, s, d, c0, 4, 1, 0);
    for (; c0 + 16 <= d; c0 += 16) pv_quad(os, prs, &iz, vc, vnew, s, d, c0, 1, 1, 0);
#endif
    if (c0 < d) {
        for (long c = c0; c < d; c++) o[c] = 0.f;
        for (long t = 0; t <= s; t++) {
            float w = pr[t] * iz;
            if (w == 0.f && t < s) continue;
            const float *vr = t < s ? vc + t * d : a->v_new + j * d;
#pragma omp simd
            for (long c = c0; c < d; c++) o[c] += w * vr[c];
        }
    }
}


/* The decode attention's grouped tasks (att_quad, bf16_att_quad): how many there are for h query heads over hkv
 * K/V heads on ``threads`` threads (0: run one task per head instead, where no two query heads share a K/V head or
 * there are fewer groups than threads), and for task c its K/V head *j, its first query head *i0 and how many query
 * heads it has (1-4). */
static long att_quad_tasks(long h, long hkv, int threads) {
    long g = h / hkv, n = hkv * ((g + 3) / 4);
    return g > 1 && n >= threads ? n : 0;
}

static int att_quad_task(long h, long hkv, long c, long *j, long *i0) {
    long g = h / hkv, quads = (g + 3) / 4, u0 = 4 * (c % quads);
    *j = c / quads, *i0 = *j * g + u0;
    return g - u0 < 4 ? (int)(g - u0) : 4;
}

/* Up to four query heads that read the same K/V head (GQA), as one task: each K row is read once for the four
 * scores and each V row once per 64 output columns for the four weighted sums, where att_head reads them once per
 * query head (three of four from L2). The same sums in the same order as att_head, so the same bits: a score is
 * dot4's per-row chain (q·k and k·q multiply the same pairs), the softmax is softmax_exp, the weighted sums as
 * pv_quad says. Task c is K/V head c / quads, query heads 4·(c % quads) onwards of its group. */
static void att_quad(void *p, long c) {
    const att_ctx *a = p;
    long s = a->s, d = a->d, j, i0;
    int nu = att_quad_task(a->h, a->hkv, c, &j, &i0);
    const float *kc = a->k_cache + j * s * d, *vc = a->v_cache + j * s * d, *mask = a->mask, *q[4];
    float *pr[4], *o[4], mx[4], iz[4], o4[4], scale = a->scale;
    for (int u = 0; u < 4; u++) {
        int uu = u < nu ? u : nu - 1; /* a missing head repeats the last one: its scores are computed, not kept */
        q[u] = a->q + (i0 + uu) * d, pr[u] = a->scratch + (i0 + uu) * (s + 1), o[u] = a->out + (i0 + uu) * d;
        mx[u] = -INFINITY;
    }
    long rb = d * (long)sizeof(float), first = 0;
    while (first < HF_ATT_FAR && first < s && mask[first] != -INFINITY) first++;
    ATT_FETCH(kc, vc, 0, first < HF_ATT_NEAR ? first : HF_ATT_NEAR, rb, 3);
    ATT_FETCH(kc, vc, HF_ATT_NEAR, first, rb, 2);
    for (long t = 0; t < s; t++) {
        if (t + HF_ATT_FAR < s && mask[t + HF_ATT_FAR] != -INFINITY) ATT_FETCH(kc, vc, t + HF_ATT_FAR, t + HF_ATT_FAR + 1, rb, 2);
        if (t + HF_ATT_NEAR < s && mask[t + HF_ATT_NEAR] != -INFINITY) ATT_FETCH(kc, vc, t + HF_ATT_NEAR, t + HF_ATT_NEAR + 1, rb, 3);
        if (mask[t] == -INFINITY) {
            for (int u = 0; u < nu; u++) pr[u][t] = -INFINITY;
            continue;
        }
        dot4(q[0], q[1], q[2], q[3], kc + t * d, d, o4);
        for (int u = 0; u < nu; u++) {
            float v = scale * o4[u] + mask[t];
            pr[u][t] = v;
            if (v > mx[u]) mx[u] = v;
        }
    }
    dot4(q[0], q[1], q[2], q[3], a->k_new + j * d, d, o4);
    for (int u = 0; u < nu; u++) {
        float v = scale * o4[u] + (a->new_mask ? *a->new_mask : 0.f);
        pr[u][s] = v;
        if (v > mx[u]) mx[u] = v;
        iz[u] = 1.f / softmax_exp(pr[u], s + 1, mx[u]);
    }
    const float *vnew = a->v_new + j * d;
    long c0 = 0;
#if defined(__AVX512F__)
    PV_QUAD_SWITCH(nu, vnew, 0)
#endif
    for (int u = 0; u < nu && c0 < d; u++) { /* columns past the last multiple of 16: att_head's loop */
        float *ou = o[u];
        for (long cc = c0; cc < d; cc++) ou[cc] = 0.f;
        for (long t = 0; t <= s; t++) {
            float w = pr[u][t] * iz[u];
            if (w == 0.f && t < s) continue;
            const float *vr = t < s ? vc + t * d : vnew;
#pragma omp simd
            for (long cc = c0; cc < d; cc++) ou[cc] += w * vr[cc];
        }
    }
}

/* One new query row per head against a read-only KV cache plus the new row (the decode step's attention).
 * q [h, d], k_new/v_new [hkv, d], caches [hkv, s, d], mask [s] additive (may hold -inf), new_mask the
 * additive mask of the new row against itself (one float, or NULL); out [h, d]. Head i reads kv head i / (h / hkv).
 * The pool's chunks are the heads (att_head), or, where query heads share a K/V head and there are at least as many
 * groups of up to four of them as threads, those groups (att_quad: the same bits, each K/V row read once per group);
 * scores sit in a per-head buffer of s + 1 floats (scratch [h, s + 1]). */
void hf_decode_attention(const float *q, const float *k_new, const float *v_new, const float *k_cache,
                         const float *v_cache, const float *mask, const float *new_mask, float *out, float *scratch,
                         long h, long hkv, long s, long d, float scale, int threads) {
    att_ctx a = {q, k_new, v_new, k_cache, v_cache, mask, new_mask, out, scratch, scale, h, hkv, s, d};
    threads = clamp_threads(threads);
    long quads = att_quad_tasks(h, hkv, threads);
    hf_run(quads ? att_quad : att_head, &a, quads ? quads : h, threads);
}

/* ---------------------------------------------------------------- one-row MLP blocks */

/* y = act(x·W (+ b)) for one row: the GEMV above with the activation applied per chunk. */
void hf_linear_act(const float *w, const float *x, const float *bias, float *y, long n, long k, int weight_t,
                   int act, int threads, float *part, int slots) {
    if (weight_t)
        gemv_kn_act(w, x, bias, y, n, k, act, threads, part, slots, 0);
    else
        gemv_nk_act(w, x, bias, y, n, k, act, threads, 0);
}

typedef struct {
    const float *x, *wg, *wu;
    float *h;
    long f, d, rows;
    int act;
} gated_ctx;

/* Chunk c of h = act(Wg·x) * (Wu·x): rows [c*rows, (c+1)*rows) of each half of Wg and of Wu (four streams,
 * continued by the next chunk); the last chunk holds the odd row. */
static void gated_chunk(void *p, long c) {
    const gated_ctx *a = p;
    long d = a->d, q = a->f / 2, i0 = c * a->rows, i1 = i0 + a->rows < q ? i0 + a->rows : q;
    const float *wg = a->wg, *wu = a->wu, *x = a->x;
    float *h = a->h, o[4];
    if (i0 >= q) {
        for (long i = 2 * q; i < a->f; i++) h[i] = act_of(dot1(wg + i * d, x, d), a->act) * dot1(wu + i * d, x, d);
        return;
    }
    for (long i = i0; i < i1; i++) {
        dot4(wg + i * d, wg + (i + q) * d, wu + i * d, wu + (i + q) * d, x, d, o);
        h[i] = act_of(o[0], a->act) * o[2];
        h[i + q] = act_of(o[1], a->act) * o[3];
    }
}

/* SwiGLU-style block for one row: h = act(Wg·x) * (Wu·x) into ``h`` ([F] scratch), then y = Wd·h when wd
 * is given. Wg, Wu [F, D], Wd [D, F], row-major, no biases. */
static void gated_mlp_res(const float *x, const float *wg, const float *wu, const float *wd, float *h,
                          const float *res, float *y, long f, long d, int act, int threads) {
    threads = clamp_threads(threads);
    gated_ctx a = {x, wg, wu, h, f, d, rows_per_chunk(d * (long)sizeof(float)), act};
    long halves = f / 2;
    hf_run(gated_chunk, &a, (halves + a.rows - 1) / a.rows + (f % 2 ? 1 : 0), threads);
    if (wd) gemv_nk_act(wd, h, 0, y, d, f, ACT_NONE, threads, res);
}

void hf_gated_mlp(const float *x, const float *wg, const float *wu, const float *wd, float *h, float *y,
                  long f, long d, int act, int threads) {
    gated_mlp_res(x, wg, wu, wd, h, 0, y, f, d, act, threads);
}

/* hf_gated_mlp with the down product's residual add (y = Wd·h + res, the same bits as the add after it; ``res``
 * may be ``y``, ``x`` must not overlap ``y``; see hf_gemv_res). */
void hf_gated_mlp_res(const float *x, const float *wg, const float *wu, const float *wd, float *h, const float *res,
                      float *y, long f, long d, int act, int threads) {
    gated_mlp_res(x, wg, wu, wd, h, res, y, f, d, act, threads);
}

/* ---------------------------------------------------------------- one token through an MoE block
 * A decode step's token through ``hetforge::moe`` (fp32, experts stacked [E, 2F, D] / [E, D, F], no shared
 * expert): the router's logits (one dot product per expert), the softmax in fp32 (max-subtracted expf, summed in
 * expert order), the top k by probability (the lower expert first on a tie), renormalised over the k when
 * ``norm``, then the k experts in ascending expert order, each a gated MLP (gated_mlp_res) whose output is scaled
 * by its weight and added to ``out`` (0 + y·w, then + y·w: the rounding of the dispatch's product then add).
 * Why: in Python the routing and the combine were about 40 ATen calls per layer (views included), each after an
 * expert's weight stream and so from a cold cache: about as long as the experts' products themselves. ``idx``/``w`` [k] and
 * ``probs`` [E] return the routing for the caller's statistics; ``h`` [F] and ``y`` [D] are scratch. Returns -1
 * (nothing done) when k is not in 1..E or E > HF_MOE_EMAX. */
#define HF_MOE_EMAX 256
int hf_moe_token(const float *x, const float *router, const float *wgu, const float *wd, long e, long d, long f,
                 int k, int norm, int act, float *h, float *y, float *out, long *idx, float *w, float *probs,
                 int threads) {
    if (k < 1 || k > e || e > HF_MOE_EMAX) return -1;
    float mx = -INFINITY, z = 0.f;
    for (long j = 0; j < e; j++) {
        probs[j] = dot1(router + j * d, x, d);
        mx = probs[j] > mx ? probs[j] : mx;
    }
    for (long j = 0; j < e; j++) z += (probs[j] = expf(probs[j] - mx));
    for (long j = 0; j < e; j++) probs[j] /= z;
    int slot[HF_MOE_EMAX];
    for (long j = 0; j < e; j++) slot[j] = -1;
    for (int t = 0; t < k; t++) {
        long b = -1;
        for (long j = 0; j < e; j++)
            if (slot[j] < 0 && (b < 0 || probs[j] > probs[b])) b = j;
        slot[b] = t, idx[t] = b, w[t] = probs[b];
    }
    if (norm) {
        float sum = 0.f;
        for (int t = 0; t < k; t++) sum += w[t];
        for (int t = 0; t < k; t++) w[t] /= sum;
    }
    for (long i = 0; i < d; i++) out[i] = 0.f;
    for (long j = 0; j < e; j++) {
        if (slot[j] < 0) continue;
        const float *g = wgu + (size_t)j * 2 * f * d;
        gated_mlp_res(x, g, g + (size_t)f * d, wd + (size_t)j * d * f, h, 0, y, f, d, act, threads);
        float wj = w[slot[j]];
        for (long i = 0; i < d; i++) out[i] += y[i] * wj;
    }
    return 0;
}

/* ---------------------------------------------------------------- int8 weight-only one-row product */

static float dot_q8(const int8_t *restrict q, const float *restrict x, long k) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (long i = 0; i < k; i++) s += (float)q[i] * x[i];
    return s;
}

typedef struct {
    const int8_t *q;
    const float *scales, *x, *bias;
    float *y;
    long n, k, rows;
    int act;
} q8_ctx;

/* Chunk c: rows [c*rows, (c+1)*rows) of each quarter of q (four streams, continued by the next chunk); the
 * last chunk holds the n % 4 tail rows. */
static void q8_chunk(void *p, long c) {
    const q8_ctx *a = p;
    long k = a->k, n = a->n, qn = n / 4, i0 = c * a->rows, i1 = i0 + a->rows < qn ? i0 + a->rows : qn;
    const int8_t *q = a->q;
    const float *x = a->x;
    float *y = a->y;
    long rows[4];
    if (i0 >= qn) {
        for (long r = 4 * qn; r < n; r++) {
            float v = dot_q8(q + r * k, x, k) * a->scales[r];
            y[r] = act_of(a->bias ? v + a->bias[r] : v, a->act);
        }
        return;
    }
    for (long i = i0; i < i1; i++) {
        const int8_t *restrict a0 = q + i * k, *restrict a1 = q + (i + qn) * k;
        const int8_t *restrict a2 = q + (i + 2 * qn) * k, *restrict a3 = q + (i + 3 * qn) * k;
        float s[4] = {0.f, 0.f, 0.f, 0.f}, s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (long c2 = 0; c2 < k; c2++) {
            s0 += (float)a0[c2] * x[c2];
            s1 += (float)a1[c2] * x[c2];
            s2 += (float)a2[c2] * x[c2];
            s3 += (float)a3[c2] * x[c2];
        }
        s[0] = s0, s[1] = s1, s[2] = s2, s[3] = s3;
        for (int j = 0; j < 4; j++) rows[j] = i + j * qn;
        for (int j = 0; j < 4; j++) {
            float v = s[j] * a->scales[rows[j]];
            y[rows[j]] = act_of(a->bias ? v + a->bias[rows[j]] : v, a->act);
        }
    }
}

/* y[n] = act(scale[n] * sum_k q[n, k] x[k] (+ bias[n])) for one fp32 row x and int8 weights q [N, K] with
 * per-output-channel fp32 scales (hetforge::linear_w8; ATen's _weight_int8pack_mm scales the same way).
 * A quarter of the bytes of the fp32 product, read like hf_gemv_nk (four streams, chunks continue them). */
void hf_gemv_q8(const int8_t *q, const float *scales, const float *x, const float *bias, float *y, long n, long k,
                int act, int threads) {
    q8_ctx a = {q, scales, x, bias, y, n, k, rows_per_chunk(k), act};
    hf_run(q8_chunk, &a, four_stream_chunks(n, a.rows), clamp_threads(threads));
}

/* ---------------------------------------------------------------- int8 weights × int8 activation blocks, one row
 * Why: hf_gemv_q8 converts every int8 weight to float and multiplies in float, which is compute-bound, not
 * bandwidth-bound. Here the row x is quantized once per call, per block of 32 (one fp32 scale d_b per block,
 * symmetric, x_q = round-half-even(x / d_b) in [-127, 127], as llama.cpp's Q8_0 does), and each weight row is
 * an int8·int8 product with exact int32 sums: AVX512-VNNI ``vpdpbusd``, AVX2 ``maddubs``, or plain C.
 *
 * The float epilogue is fixed so every path gives the same bits: block b's 32 products are summed in eight
 * int32 lanes of four consecutive products (lane l: elements 4l..4l+3, exactly what vpdpbusd/maddubs+madd
 * produce); lane l of block b is added, as ``acc[(b % 2) * 8 + l] = fma(d_b, (float)sum, acc[..])`` (one
 * rounding: a fused multiply-add on every path, fmaf in C), to one of 16 float accumulators; the 16 are reduced
 * by halves (8, 4, 2, 1); then ``* scale[n] (+ bias[n])``, act. */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { Q8A_PORTABLE = 0, Q8A_AVX2 = 1, Q8A_VNNI = 2 };

static int q8a_best(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return Q8A_VNNI;
#elif defined(__AVX2__) && defined(__FMA__)
    return Q8A_AVX2;
#else
    return Q8A_PORTABLE;
#endif
}

static _Atomic int q8a_forced = -1; /* test hook: a lower path than the best compiled one, or -1 */

/* Force path ``path`` (0 portable, 1 AVX2, 2 AVX512-VNNI; clamped to the best compiled), -1 for the best;
 * returns the best path this build has. */
int hf_q8a_path(int path) {
    atomic_store(&q8a_forced, path);
    return q8a_best();
}

typedef struct {
    const int8_t *q, *xq;
    const float *scales, *xd, *xd8, *bias;
    float *y;
    long n, k, rows;
    int act, path;
} q8a_ctx;

/* Lane sums of block b of one row into acc (scalar; also the partial last block of every path). */
static void q8a_block_scalar(const int8_t *restrict w, const int8_t *restrict xq, float d, long b, long k,
                             float *acc) {
    for (int l = 0; l < 8; l++) {
        int32_t s = 0;
        for (int t = 0; t < 4; t++) {
            long i = b * 32 + l * 4 + t;
            if (i < k) s += (int32_t)w[i] * (int32_t)xq[i];
        }
        acc[(b & 1) * 8 + l] = fmaf(d, (float)s, acc[(b & 1) * 8 + l]);
    }
}

static float q8a_reduce(float *acc) {
    for (int h = 8; h >= 1; h /= 2)
        for (int i = 0; i < h; i++) acc[i] += acc[i + h];
    return acc[0];
}

/* The four rows w[0..3] · x_q, each as the 16-accumulator sum above, into out[0..3]. */
static void q8a_dot4(const int8_t *const *w, const int8_t *xq, const float *xd, const float *xd8, long k, int path,
                     float *out) {
    float acc[4][16];
    memset(acc, 0, sizeof acc);
    long nb = (k + 31) / 32, full = k / 32, b = 0;
    (void)full, (void)path; /* unused in a build without AVX2 */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (path == Q8A_VNNI) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const __m512i z = _mm512_setzero_si512();
        for (; b + 2 <= full; b += 2) {
            __m512i xv = _mm512_loadu_si512((const void *)(xq + b * 32));
            __m512 dv = _mm512_loadu_ps(xd8 + b * 8);
#define HF_Q8A_VNNI_ROW(j, aj)                                                                                     \
    {                                                                                                          \
        HF_PREFETCH(w[j] + b * 32);                                                                            \
        __m512i wv = _mm512_loadu_si512((const void *)(w[j] + b * 32));                                        \
        __m512i sx = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wv), z, xv);                                 \
        __m512i s = _mm512_dpbusd_epi32(z, _mm512_abs_epi8(wv), sx);                                           \
        aj = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dv, aj);                                                   \
    }
            HF_Q8A_VNNI_ROW(0, a0) HF_Q8A_VNNI_ROW(1, a1) HF_Q8A_VNNI_ROW(2, a2) HF_Q8A_VNNI_ROW(3, a3)
#undef HF_Q8A_VNNI_ROW
        }
        _mm512_storeu_ps(acc[0], a0), _mm512_storeu_ps(acc[1], a1);
        _mm512_storeu_ps(acc[2], a2), _mm512_storeu_ps(acc[3], a3);
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (path == Q8A_AVX2) {
        __m256 lo[4], hi[4];
        const __m256i ones = _mm256_set1_epi16(1);
        for (int j = 0; j < 4; j++) lo[j] = hi[j] = _mm256_setzero_ps();
        for (; b < full; b++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * 32));
            __m256 dv = _mm256_loadu_ps(xd8 + b * 8);
            for (int j = 0; j < 4; j++) {
                if (b % 2 == 0) HF_PREFETCH(w[j] + b * 32); /* one request per 64-byte line, as above */
                __m256i wv = _mm256_loadu_si256((const __m256i *)(w[j] + b * 32));
                __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
                __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
                if (b & 1) hi[j] = _mm256_fmadd_ps(f, dv, hi[j]);
                else lo[j] = _mm256_fmadd_ps(f, dv, lo[j]);
            }
        }
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(acc[j], lo[j]), _mm256_storeu_ps(acc[j] + 8, hi[j]);
    }
#endif
    for (; b < nb; b++)
        for (int j = 0; j < 4; j++) q8a_block_scalar(w[j], xq, xd[b], b, k, acc[j]);
    for (int j = 0; j < 4; j++) out[j] = q8a_reduce(acc[j]);
}

static float q8a_dot1(const int8_t *w, const int8_t *xq, const float *xd, long k) {
    float acc[16] = {0};
    for (long b = 0; b < (k + 31) / 32; b++) q8a_block_scalar(w, xq, xd[b], b, k, acc);
    return q8a_reduce(acc);
}

/* Chunk c: rows [c*rows, (c+1)*rows) of each quarter of q (four streams), the last chunk the n % 4 tail. */
static void q8a_chunk(void *p, long c) {
    const q8a_ctx *a = p;
    long k = a->k, n = a->n, qn = n / 4, i0 = c * a->rows, i1 = i0 + a->rows < qn ? i0 + a->rows : qn;
    if (i0 >= qn) {
        for (long r = 4 * qn; r < n; r++) {
            float v = q8a_dot1(a->q + r * k, a->xq, a->xd, k) * a->scales[r];
            a->y[r] = act_of(a->bias ? v + a->bias[r] : v, a->act);
        }
        return;
    }
    for (long i = i0; i < i1; i++) {
        const int8_t *w[4] = {a->q + i * k, a->q + (i + qn) * k, a->q + (i + 2 * qn) * k, a->q + (i + 3 * qn) * k};
        float o[4];
        q8a_dot4(w, a->xq, a->xd, a->xd8, k, a->path, o);
        for (int j = 0; j < 4; j++) {
            long r = i + j * qn;
            float v = o[j] * a->scales[r];
            a->y[r] = act_of(a->bias ? v + a->bias[r] : v, a->act);
        }
    }
}

/* Quantize x [k] per block of 32: xq [nb*32] (zero-padded), xd [nb] block scales, xd8 [nb*8] each scale 8x. */
void hf_quantize_q8_blocks(const float *x, long k, int8_t *xq, float *xd, float *xd8) {
    long nb = (k + 31) / 32, b = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    /* The loop below on 16 lanes, the same float ops: the max of |x| (exact in any order), d and 1/d in scalar,
     * x·(1/d) rounded in the current mode (nearbyintf), clamped with NaN passing through, then the truncating
     * conversion the (int8_t) cast compiles to (a NaN gives 0). */
    const __m512 big = _mm512_set1_ps(3.40282347e38f), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
    const __m512i absm = _mm512_set1_epi32(0x7fffffff);
    for (; b < nb; b++) {
        long left = k - b * 32;
        __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        __mmask16 m1 = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
        __m512 v0 = _mm512_maskz_loadu_ps(m0, x + b * 32), v1 = _mm512_maskz_loadu_ps(m1, x + b * 32 + 16);
        __m512 a0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v0), absm));
        __m512 a1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v1), absm));
        int bad = (_mm512_cmp_ps_mask(a0, big, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1, big, _CMP_LE_OQ)) != 0xffff;
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
        float d = bad ? NAN : amax / 127.f, id = bad || d == 0.f ? 0.f : 1.f / d;
        __m512 idv = _mm512_set1_ps(id);
        __m512 r0 = _mm512_roundscale_ps(_mm512_mul_ps(v0, idv), _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
        __m512 r1 = _mm512_roundscale_ps(_mm512_mul_ps(v1, idv), _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
        r0 = _mm512_max_ps(lo, _mm512_min_ps(hi, r0)), r1 = _mm512_max_ps(lo, _mm512_min_ps(hi, r1));
        _mm_storeu_si128((__m128i *)(xq + b * 32), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(r0)));
        _mm_storeu_si128((__m128i *)(xq + b * 32 + 16), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(r1)));
        xd[b] = d;
        _mm256_storeu_ps(xd8 + b * 8, _mm256_set1_ps(d));
    }
#elif defined(__AVX2__)
    /* The same on 8 lanes for the full blocks (the partial last one below): a NaN product (only in a block with
     * NaN or ±Inf, whose scale is NaN) becomes 0 before the conversion, as the (int8_t) cast of NaN gives. */
    const __m256 big = _mm256_set1_ps(3.40282347e38f), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (; b < k / 32; b++) {
        __m256 v[4], a[4];
        int ok = 0xff;
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + b * 32 + i * 8), a[i] = _mm256_and_ps(v[i], absm);
            ok &= _mm256_movemask_ps(_mm256_cmp_ps(a[i], big, _CMP_LE_OQ));
        }
        __m256 m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        int bad = ok != 0xff;
        float d = bad ? NAN : amax / 127.f, id = bad || d == 0.f ? 0.f : 1.f / d;
        __m256 idv = _mm256_set1_ps(id);
        __m256i r[4];
        for (int i = 0; i < 4; i++) {
            __m256 t = _mm256_round_ps(_mm256_mul_ps(v[i], idv), _MM_FROUND_CUR_DIRECTION);
            t = _mm256_and_ps(t, _mm256_cmp_ps(t, t, _CMP_ORD_Q)); /* NaN -> 0 */
            r[i] = _mm256_cvttps_epi32(_mm256_max_ps(lo, _mm256_min_ps(hi, t)));
        }
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
        _mm256_storeu_si256((__m256i *)(xq + b * 32), _mm256_permutevar8x32_epi32(p, order));
        xd[b] = d;
        _mm256_storeu_ps(xd8 + b * 8, _mm256_set1_ps(d));
    }
#endif
    for (; b < nb; b++) {
        float amax = 0.f;
        int bad = 0; /* a NaN or ±Inf in the block: scale NaN, x_q 0, so every sum with this block is NaN */
        for (long i = b * 32; i < b * 32 + 32 && i < k; i++) {
            float ax = fabsf(x[i]);
            amax = fmaxf(amax, ax); /* fmaxf drops a NaN: caught by ``bad`` */
            bad |= !(ax <= 3.40282347e38f);
        }
        float d = bad ? NAN : amax / 127.f, id = bad || d == 0.f ? 0.f : 1.f / d;
        for (long i = b * 32; i < b * 32 + 32; i++) {
            float v = i < k ? nearbyintf(x[i] * id) : 0.f;
            xq[i] = (int8_t)(v > 127.f ? 127.f : v < -127.f ? -127.f : v);
        }
        xd[b] = d;
        for (int l = 0; l < 8; l++) xd8[b * 8 + l] = d;
    }
}

/* y[n] = act(scale[n] * sum_b d_b * sum_{k in b} q[n, k] x_q[k] (+ bias[n])): x quantized per block of 32 (see
 * above), int8·int8 products, four weight streams per chunk as hf_gemv_q8. Same bits on every path/CPU. A block
 * of x holding NaN or ±Inf makes every output NaN. Returns 0, or -1 when its scratch cannot be allocated. */
int hf_gemv_q8a(const int8_t *q, const float *scales, const float *x, const float *bias, float *y, long n, long k,
                int act, int threads) {
    long nb = (k + 31) / 32;
    int8_t *xq = aligned_alloc(64, (size_t)((nb * 32 + 63) / 64 * 64));
    float *xd = malloc((size_t)(nb + 1) * sizeof(float)), *xd8 = aligned_alloc(64, (size_t)((nb * 32 + 63) / 64 * 64));
    if (!xq || !xd || !xd8) { /* returns -1, y untouched: the caller raises */
        free(xq), free(xd), free(xd8);
        return -1;
    }
    hf_quantize_q8_blocks(x, k, xq, xd, xd8);
    int path = q8a_best(), f = atomic_load(&q8a_forced);
    if (f >= 0 && f < path) path = f;
    q8a_ctx a = {q, xq, scales, xd, xd8, bias, y, n, k, rows_per_chunk(k), act, path};
    hf_run(q8a_chunk, &a, four_stream_chunks(n, a.rows), clamp_threads(threads));
    free(xq), free(xd), free(xd8);
    return 0;
}

/* ---------------------------------------------------------------- int8 weights × int8 activation blocks, several rows
 * Why: a prefill (or chunk) of ``m`` rows through a w8 linear. Dequantizing the weight to fp32 on every call
 * and running a float GEMM costs a pass over the weight plus a float GEMM at ATen's speed; here each row is
 * quantized per block of 32 exactly as hf_gemv_q8a does it (so a prefill computes what a decode step
 * computes: row r of the result has the bits hf_gemv_q8a gives for row r) and the products are int8·int8 with
 * exact int32 block sums, the weight read once per call from memory and reused from cache by every row.
 *
 * Work: chunks of HF_Q8G_WROWS weight rows (×all m rows), claimed through the pool like the GEMVs. Inside a
 * chunk a tile of Q8G_R x rows × Q8G_C weight rows keeps its R·C accumulators and C weight vectors in registers
 * while it walks K. The AVX512-VNNI tile uses the unsigned form of vpdpbusd with the weight as the unsigned
 * side: w_u = w ^ 0x80 = w + 128 (one xor per weight vector), and each product's lane sum starts at
 * c = -128·Σ x_q of the lane (made once per x row), so (w + 128)·x_q - 128·Σx_q = w·x_q is one vpdpbusd with an
 * exact int32 lane sum; the float epilogue of every lane is hf_gemv_q8a's (see above). Each x row is packed per
 * 64 bytes of K as [x_q | c | the two block scales 8× each] (one sequential stream per row). The tile's 20
 * reductions, scale, bias and ReLU run on whole vectors (same float ops per output; other activations in
 * scalar code). The AVX2 and portable paths run hf_gemv_q8a's own four-row dot (q8a_dot4) per x row: same
 * bits on every path. Why this shape (measured): the earlier 4 × 4 tile with x as the unsigned side spent
 * 4 vpdpbusd + 4 subtractions per step on the correction, spilled a register, reduced each accumulator alone
 * and called act_of per output, and the scalar quantizer (a libm fmaxf call per element) was a large share
 * of a product with few output columns. */

#ifndef HF_Q8G_WROWS
#define HF_Q8G_WROWS 80 /* weight rows per chunk (a multiple of Q8G_C and of 4): the x rows stream once per chunk */
#endif
#define Q8G_R 4 /* x rows per VNNI tile (the epilogue of q8g_tile_vnni is written for 4 × 5) */
#define Q8G_C 5 /* weight rows per VNNI tile: 20 accumulators + 5 weights + 5 more of the 32 zmm registers */
#define Q8G_STEP 192 /* packed bytes per row per 64 bytes of K: x_q (64), c (16 int32), d (16 fp32) */

typedef struct {
    const float *x;
    int8_t *xq;
    uint8_t *xp;
    float *xd, *xd8;
    long k, kp, nb, steps, rows;
} q8q_ctx;

/* Quantize x's rows [c*rows, (c+1)*rows) per block of 32 (hf_quantize_q8_blocks), and pack them for the VNNI
 * tile (xp, when set: the full block pairs only; a partial or odd last block runs in scalar code). */
static void q8q_chunk(void *p, long c) {
    const q8q_ctx *a = p;
    for (long r = c * a->rows; r < (c + 1) * a->rows; r++) {
        int8_t *xq = a->xq + r * a->kp;
        float *xd8 = a->xd8 + r * a->nb * 8;
        hf_quantize_q8_blocks(a->x + r * a->k, a->k, xq, a->xd + r * a->nb, xd8);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        if (a->xp) {
            const __m512i z = _mm512_setzero_si512(), c128 = _mm512_set1_epi8((char)0x80);
            uint8_t *o = a->xp + r * a->steps * Q8G_STEP;
            for (long s = 0; s < a->steps; s++, o += Q8G_STEP) {
                __m512i xv = _mm512_loadu_si512((const void *)(xq + s * 64));
                _mm512_storeu_si512((void *)o, xv);
                _mm512_storeu_si512((void *)(o + 64), _mm512_sub_epi32(z, _mm512_dpbusd_epi32(z, c128, xv)));
                _mm512_storeu_ps((void *)(o + 128), _mm512_loadu_ps(xd8 + s * 16));
            }
        }
#endif
    }
}

typedef struct {
    const int8_t *q, *xq;
    const uint8_t *xp;
    const float *scales, *xd, *xd8, *bias;
    float *y;
    long m, n, k, kp, nb, steps;
    int act, path;
} q8g_ctx;

static inline float q8g_out(const q8g_ctx *a, long r, long j, float dotv) {
    float v = dotv * a->scales[j];
    return act_of(a->bias ? v + a->bias[j] : v, a->act);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* q8a_reduce (halves 8, 4, 2, 1) of 16 accumulators at once, in two steps with the same float sums, the lower
 * half always the first operand. This one: the halves 8 and 4 of four accumulators, [t4(a) | t4(b) | t4(c) |
 * t4(d)] in 128-bit lanes (t8 = low 256 + high 256 bits, t4 = low 128 + high 128 bits of t8). */
static inline __m512 q8g_reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 p = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The halves 2 and 1 of four q8g_reduce4 results: element 4L + e is q8a_reduce of 128-bit lane L of s_e. */
static inline __m512 q8g_reduce16(__m512 s0, __m512 s1, __m512 s2, __m512 s3) {
    __m512 t01 = _mm512_add_ps(_mm512_shuffle_ps(s0, s1, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_ps(s0, s1, _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 t23 = _mm512_add_ps(_mm512_shuffle_ps(s2, s3, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_ps(s2, s3, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(t01, t23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* v * scale (+ bias), then ReLU or nothing: q8g_out's float ops on 16 lanes (ReLU keeps NaN, as act_of). */
static inline __m512 q8g_out16(__m512 v, __m512 sc, const __m512 *bias, int relu) {
    v = _mm512_mul_ps(v, sc);
    if (bias) v = _mm512_add_ps(v, *bias);
    if (relu) v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LE_OQ), v, _mm512_setzero_ps());
    return v;
}

/* The 4 × 5 tile: y[rows r0.., weight rows jj..] for x rows xp[0..3] (packed streams; xq/xd: plain blocks for
 * the blocks past the last full pair) and weight rows w[0..4], accumulated as hf_gemv_q8a does. ``rows``,
 * ``cols``: how many of the tile's rows and columns are real (the others repeat a row and are not stored). */
static void q8g_tile_vnni(const q8g_ctx *a, const int8_t *const *w, const uint8_t *const *xp,
                          const int8_t *const *xq, const float *const *xd, const long *rr, const long *jr, long jj,
                          int rows, int cols) {
    long k = a->k, nb = a->nb, steps = a->steps;
    __m512 acc[Q8G_R][Q8G_C];
    const __m512i flip = _mm512_set1_epi8((char)0x80);
#pragma GCC unroll 8
    for (int i = 0; i < Q8G_R; i++)
#pragma GCC unroll 8
        for (int j = 0; j < Q8G_C; j++) acc[i][j] = _mm512_setzero_ps();
    for (long s = 0; s < steps; s++) {
        __m512i wu[Q8G_C];
#pragma GCC unroll 8
        for (int j = 0; j < Q8G_C; j++)
            wu[j] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w[j] + s * 64)), flip);
#pragma GCC unroll 8
        for (int i = 0; i < Q8G_R; i++) {
            const uint8_t *p = xp[i] + s * Q8G_STEP;
            __m512i xv = _mm512_loadu_si512((const void *)p), c = _mm512_loadu_si512((const void *)(p + 64));
            __m512 dv = _mm512_loadu_ps((const float *)(p + 128));
#pragma GCC unroll 8
            for (int j = 0; j < Q8G_C; j++)
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, wu[j], xv)), dv, acc[i][j]);
        }
    }
    int relu = a->act == ACT_RELU;
    if (2 * steps == nb && (relu || a->act == ACT_NONE)) { /* all in registers: 4 × 4 + 4 × 1 sums */
        __m512 r4 = q8g_reduce16(q8g_reduce4(acc[0][0], acc[1][0], acc[2][0], acc[3][0]),
                                 q8g_reduce4(acc[0][1], acc[1][1], acc[2][1], acc[3][1]),
                                 q8g_reduce4(acc[0][2], acc[1][2], acc[2][2], acc[3][2]),
                                 q8g_reduce4(acc[0][3], acc[1][3], acc[2][3], acc[3][3])); /* 4i + j: (i, j) */
        __m512 s4 = q8g_reduce4(acc[0][4], acc[1][4], acc[2][4], acc[3][4]);
        __m512 r1 = q8g_reduce16(s4, s4, s4, s4); /* 4i + e: (i, 4) */
        __mmask16 cm = (__mmask16)((1u << (cols < 4 ? cols : 4)) - 1);
        __m512 sc4 = _mm512_broadcast_f32x4(_mm_maskz_loadu_ps(cm, a->scales + jj)), sc1 = _mm512_set1_ps(a->scales[jr[4]]);
        __m512 b4, b1;
        if (a->bias) b4 = _mm512_broadcast_f32x4(_mm_maskz_loadu_ps(cm, a->bias + jj)), b1 = _mm512_set1_ps(a->bias[jr[4]]);
        r4 = q8g_out16(r4, sc4, a->bias ? &b4 : NULL, relu);
        r1 = q8g_out16(r1, sc1, a->bias ? &b1 : NULL, relu);
        float o4[16], o1[16];
        _mm512_storeu_ps(o4, r4), _mm512_storeu_ps(o1, r1);
        for (int i = 0; i < rows; i++) {
            float *yr = a->y + rr[i] * a->n + jj;
            _mm_mask_storeu_ps(yr, cm, _mm_loadu_ps(o4 + 4 * i));
            if (cols > 4) yr[4] = o1[4 * i];
        }
        return;
    }
    float lanes[Q8G_R][Q8G_C][16]; /* constant indices above: the accumulators stay in registers in the loop */
#pragma GCC unroll 8
    for (int i = 0; i < Q8G_R; i++)
#pragma GCC unroll 8
        for (int j = 0; j < Q8G_C; j++) _mm512_storeu_ps(lanes[i][j], acc[i][j]);
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) {
            for (long bb = 2 * steps; bb < nb; bb++) q8a_block_scalar(w[j], xq[i], xd[i][bb], bb, k, lanes[i][j]);
            a->y[rr[i] * a->n + jr[j]] = q8g_out(a, rr[i], jr[j], q8a_reduce(lanes[i][j]));
        }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* One block b of x rows xq[0..1] against weight rows w[0..1] (AVX2): |w| made once per weight row and shared by
 * both x rows, the lane sums maddubs(|w|, sign(x, w)) widened by madd, folded as q8a_dot4's AVX2 path does. */
static inline void q8g_blk2x2(const int8_t *const *w, const int8_t *const *xq, const float *const *xd8, long b,
                              __m256 acc[2][2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i w0 = _mm256_loadu_si256((const __m256i *)(w[0] + b * 32));
    __m256i w1 = _mm256_loadu_si256((const __m256i *)(w[1] + b * 32));
    __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xq[i] + b * 32));
        __m256 dv = _mm256_loadu_ps(xd8[i] + b * 8);
        __m256 f0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xv, w0)), ones));
        __m256 f1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xv, w1)), ones));
        acc[i][0] = _mm256_fmadd_ps(f0, dv, acc[i][0]), acc[i][1] = _mm256_fmadd_ps(f1, dv, acc[i][1]);
    }
}

/* q8a_reduce (halves 8, 4, 2, 1: the same sums in the same order, each with the same first operand) of the 2 × 2
 * tile's four accumulator pairs (lo = lanes 0..7, hi = lanes 8..15) at once: [o00, o01, o10, o11]. */
static inline __m128 q8g_reduce4_avx2(__m256 lo[2][2], __m256 hi[2][2]) {
    __m256 h00 = _mm256_add_ps(lo[0][0], hi[0][0]), h01 = _mm256_add_ps(lo[0][1], hi[0][1]);
    __m256 h10 = _mm256_add_ps(lo[1][0], hi[1][0]), h11 = _mm256_add_ps(lo[1][1], hi[1][1]);
    /* [h4(00) | h4(01)] and [h4(10) | h4(11)]: the low 128 bits plus the high 128 bits */
    __m256 t0 = _mm256_add_ps(_mm256_permute2f128_ps(h00, h01, 0x20), _mm256_permute2f128_ps(h00, h01, 0x31));
    __m256 t1 = _mm256_add_ps(_mm256_permute2f128_ps(h10, h11, 0x20), _mm256_permute2f128_ps(h10, h11, 0x31));
    /* per 128-bit lane [h2 of t0's | h2 of t1's]: elements 0, 1 plus elements 2, 3 */
    __m256 h2 = _mm256_add_ps(_mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
    /* element 0 plus element 1: [o00, o10, o00, o10 | o01, o11, o01, o11] */
    __m256 h1 = _mm256_add_ps(_mm256_shuffle_ps(h2, h2, _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm256_shuffle_ps(h2, h2, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm_unpacklo_ps(_mm256_castps256_ps128(h1), _mm256_extractf128_ps(h1, 1));
}

/* The tile of x rows xq[0..1] × weight rows w[0..1] (q8a_dot4's bits), as [o00, o01, o10, o11]: the full blocks in
 * pairs (even blocks into lo, odd into hi, all in registers), the partial last block in scalar code. */
static __m128 q8g_tile_avx2(const int8_t *const *w, const int8_t *const *xq, const float *const *xd,
                            const float *const *xd8, long k) {
    long nb = (k + 31) / 32, full = k / 32, b = 0;
    __m256 lo[2][2], hi[2][2];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) lo[i][j] = hi[i][j] = _mm256_setzero_ps();
    for (; b + 2 <= full; b += 2) {
        q8g_blk2x2(w, xq, xd8, b, lo);
        q8g_blk2x2(w, xq, xd8, b + 1, hi);
    }
    if (b < full) q8g_blk2x2(w, xq, xd8, b++, lo);
    if (b == nb) return q8g_reduce4_avx2(lo, hi);
    float out[4];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) {
            float acc[16];
            _mm256_storeu_ps(acc, lo[i][j]), _mm256_storeu_ps(acc + 8, hi[i][j]);
            q8a_block_scalar(w[j], xq[i], xd[i][b], b, k, acc);
            out[2 * i + j] = q8a_reduce(acc);
        }
    return _mm_loadu_ps(out);
}

/* The 4 × 4 tile of x rows rr[0..3] × weight rows jr[0..3] (four 2 × 2 register tiles) into y: q8g_out's float
 * ops on 4 columns at once for ReLU or no activation, act_of per output for the others. */
static void q8g_tile4_avx2(const q8g_ctx *a, const int8_t *const *w, const long *rr, const long *jr, long jj,
                           long j1) {
    long kp = a->kp, nb = a->nb;
    __m128 row[4];
    for (int i = 0; i < 4; i += 2) {
        const int8_t *xq[2] = {a->xq + rr[i] * kp, a->xq + rr[i + 1] * kp};
        const float *xd[2] = {a->xd + rr[i] * nb, a->xd + rr[i + 1] * nb};
        const float *xd8[2] = {a->xd8 + rr[i] * nb * 8, a->xd8 + rr[i + 1] * nb * 8};
        __m128 o0 = q8g_tile_avx2(w, xq, xd, xd8, a->k), o1 = q8g_tile_avx2(w + 2, xq, xd, xd8, a->k);
        row[i] = _mm_movelh_ps(o0, o1), row[i + 1] = _mm_movehl_ps(o1, o0); /* [x row, weight rows 0..3] */
    }
    int cols = j1 - jj < 4 ? (int)(j1 - jj) : 4, rows = a->m - rr[0] < 4 ? (int)(a->m - rr[0]) : 4;
    if (a->act != ACT_NONE && a->act != ACT_RELU) {
        float o[4];
        for (int i = 0; i < rows; i++) {
            _mm_storeu_ps(o, row[i]);
            for (int j = 0; j < cols; j++) a->y[rr[i] * a->n + jr[j]] = q8g_out(a, rr[i], jr[j], o[j]);
        }
        return;
    }
    __m128 sc = _mm_setr_ps(a->scales[jr[0]], a->scales[jr[1]], a->scales[jr[2]], a->scales[jr[3]]), bv = sc;
    if (a->bias) bv = _mm_setr_ps(a->bias[jr[0]], a->bias[jr[1]], a->bias[jr[2]], a->bias[jr[3]]);
    __m128i keep = _mm_cmpgt_epi32(_mm_set1_epi32(cols), _mm_setr_epi32(0, 1, 2, 3));
    for (int i = 0; i < rows; i++) {
        __m128 v = _mm_mul_ps(row[i], sc);
        if (a->bias) v = _mm_add_ps(v, bv);
        if (a->act == ACT_RELU) v = _mm_blendv_ps(v, _mm_setzero_ps(), _mm_cmp_ps(v, _mm_setzero_ps(), _CMP_LE_OQ));
        _mm_maskstore_ps(a->y + rr[i] * a->n + jj, keep, v); /* columns jj.. are jr[0..cols) */
    }
}
#endif

/* Chunk c: weight rows [c*HF_Q8G_WROWS, ...) against every x row, in tiles of x rows × weight rows (R × C on
 * VNNI, 4 × 4 otherwise: four 2 × 2 register tiles on AVX2). A tile edge past the last row repeats that row (its
 * products are computed and dropped): every tile is full. */
static void q8g_chunk(void *p, long c) {
    const q8g_ctx *a = p;
    long j0 = c * HF_Q8G_WROWS, j1 = j0 + HF_Q8G_WROWS < a->n ? j0 + HF_Q8G_WROWS : a->n, k = a->k, kp = a->kp;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (a->path == Q8A_VNNI) {
        for (long r0 = 0; r0 < a->m; r0 += Q8G_R) {
            long rr[Q8G_R];
            const uint8_t *xp[Q8G_R];
            const int8_t *xq[Q8G_R];
            const float *xd[Q8G_R];
            for (int i = 0; i < Q8G_R; i++) {
                rr[i] = r0 + i < a->m ? r0 + i : a->m - 1;
                xp[i] = a->xp + rr[i] * a->steps * Q8G_STEP, xq[i] = a->xq + rr[i] * kp, xd[i] = a->xd + rr[i] * a->nb;
            }
            for (long jj = j0; jj < j1; jj += Q8G_C) {
                long jr[Q8G_C];
                const int8_t *w[Q8G_C];
                for (int j = 0; j < Q8G_C; j++) {
                    jr[j] = jj + j < j1 ? jj + j : j1 - 1;
                    w[j] = a->q + jr[j] * k;
                }
                q8g_tile_vnni(a, w, xp, xq, xd, rr, jr, jj, a->m - r0 < Q8G_R ? (int)(a->m - r0) : Q8G_R,
                              j1 - jj < Q8G_C ? (int)(j1 - jj) : Q8G_C);
            }
        }
        return;
    }
#endif
    for (long r0 = 0; r0 < a->m; r0 += 4) {
        long rr[4];
        for (int i = 0; i < 4; i++) rr[i] = r0 + i < a->m ? r0 + i : a->m - 1;
        for (long jj = j0; jj < j1; jj += 4) {
            long jr[4];
            const int8_t *w[4];
            for (int j = 0; j < 4; j++) {
                jr[j] = jj + j < j1 ? jj + j : j1 - 1;
                w[j] = a->q + jr[j] * k;
            }
#if defined(__AVX2__) && defined(__FMA__)
            if (a->path == Q8A_AVX2) {
                q8g_tile4_avx2(a, w, rr, jr, jj, j1);
                continue;
            }
#endif
            float out[4][4];
            for (int i = 0; i < 4; i++)
                q8a_dot4(w, a->xq + rr[i] * kp, a->xd + rr[i] * a->nb, a->xd8 + rr[i] * a->nb * 8, k, a->path, out[i]);
            for (int i = 0; i < 4 && r0 + i < a->m; i++)
                for (int j = 0; j < 4 && jj + j < j1; j++) a->y[rr[i] * a->n + jr[j]] = q8g_out(a, rr[i], jr[j], out[i][j]);
        }
    }
}

/* y[m, n] = act(scale[n] * Σ_b d_{r,b} Σ_{k in b} q[n, k] x_q[r, k] (+ bias[n])) for m fp32 rows x [m, k]: each
 * row quantized per block of 32 as hf_gemv_q8a does (row r of y has hf_gemv_q8a's bits for row r, on every
 * path). A block holding NaN or ±Inf gets scale NaN, so the rows it meets come out NaN (as a float product
 * would give NaN or ±Inf). Returns 0, or -1 when the scratch for the quantized rows cannot be allocated (y is
 * then untouched). */
int hf_gemm_q8a(const int8_t *q, const float *scales, const float *x, const float *bias, float *y, long m, long n,
                long k, int act, int threads) {
    if (m <= 0 || n <= 0) return 0;
    long nb = (k + 31) / 32, kp = nb * 32, steps = k / 64;
    int path = q8a_best(), f = atomic_load(&q8a_forced);
    if (f >= 0 && f < path) path = f;
    size_t qbytes = ((size_t)m * kp + 64) / 64 * 64, dbytes = ((size_t)m * nb * 8 * sizeof(float) + 64) / 64 * 64;
    size_t pbytes = ((size_t)m * steps * Q8G_STEP + 64) / 64 * 64;
    int8_t *xq = aligned_alloc(64, qbytes);
    uint8_t *xp = path == Q8A_VNNI ? aligned_alloc(64, pbytes) : NULL;
    float *xd = malloc((size_t)(m * nb + 1) * sizeof(float)), *xd8 = aligned_alloc(64, dbytes);
    if (!xq || !xd || !xd8 || (path == Q8A_VNNI && !xp)) {
        free(xq), free(xp), free(xd), free(xd8);
        return -1;
    }
    threads = clamp_threads(threads);
    long qrows = m < 8 ? 1 : 8;
    q8q_ctx qa = {x, xq, xp, xd, xd8, k, kp, nb, steps, qrows};
    if (m % qrows) { /* rows in whole chunks: the last chunk's tail rows run here */
        for (long r = m / qrows * qrows; r < m; r++) {
            q8q_ctx one = qa;
            one.rows = 1;
            q8q_chunk(&one, r);
        }
    }
    /* on torch's OpenMP team, as the prefill attention and norms between these GEMMs (see hf_run_team): on the
     * pool a w8 prefill was clearly slower (measured: docs/arch/runtime.md, native kernels) */
    hf_run_team(q8q_chunk, &qa, m / qrows, threads);
    q8g_ctx a = {q, xq, xp, scales, xd, xd8, bias, y, m, n, k, kp, nb, steps, act, path};
    hf_run_team(q8g_chunk, &a, (n + HF_Q8G_WROWS - 1) / HF_Q8G_WROWS, threads);
    free(xq), free(xp), free(xd), free(xd8);
    return 0;
}

/* ---------------------------------------------------------------- int4 weights × int8 activation blocks (w4, q8)
 * Why: a w4 prefill dequantized the whole int4 weight to fp32 with ATen ops on every call and ran a float GEMM
 * (a pass of several fp32 copies of the weight per call, then a GEMM at fp32 speed). These are the int4
 * counterparts of hf_gemv_q8a / hf_gemm_q8a (llama.cpp's Q4_0 × Q8_0 idea on hetforge's int4): x quantized per
 * block of 32 as hf_quantize_q8_blocks does it, the weight nibbles widened to bytes in registers, int8 products
 * with exact int32 block sums, one float epilogue per (block × 16 outputs).
 *
 * Weight: read in place from ATen's _convert_weight_to_int4pack_for_cpu layout (no second copy): rows in blocks of
 * B = Q4_BLK (64 on an AVX-512 torch build, 32 on an AVX2 one), byte blk·(B/2)·K + (B/2)·k + i (i < B/2) holds
 * u[blk·B + i, k] (low nibble) and u[blk·B + B/2 + i, k] (high), u = q + 8 in 0..15 (the caller checks the build's
 * layout and N % B == 0);
 * scales_zeros [K/G, N, 2] fp32 with zeros 0 (hetforge's int4 is symmetric; the caller checks).
 *
 * Arithmetic (every path, the same bits): for output n and x block b (group g = 32b / G):
 * dot = Σ_{k in b} (u[n, k] − 8)·x_q[k] (exact int32); acc = acc + (d_b · s[g, n]) · (float)dot, three separate
 * roundings (no fused multiply-add), blocks in order from acc = 0; then (+ bias[n]), act. A block of x holding
 * NaN or ±Inf has d_b = NaN, so its outputs are NaN.
 *
 * AVX512-VNNI + VBMI path: one vpermt2b per 32 rows turns four k columns (128 packed bytes) into a vector whose
 * dword j holds the four k bytes of row j (low nibbles) and of row j + 32 (high), split by and/shift; vpdpbusd
 * takes u (0..15) as its unsigned side and x_q's four bytes broadcast as the signed side, the int32
 * accumulator starting at −8·Σ x_q of the block, so it ends at Σ (u − 8)·x_q. The GEMV (decode) widens in
 * registers; the GEMM widens each 64-row block once into a per-thread buffer (64·K bytes) and runs 6 x rows ×
 * 32 outputs tiles over it (12 int32 + 12 float accumulators).
 *
 * AVX2 + FMA path (no AVX-512): the layout of AVX2 torch builds, blocks of 32 rows (byte blk·16K + 16k + i,
 * i < 16: rows blk·32 + i low, blk·32 + 16 + i high). Two 32-byte loads hold four k columns of the block; one
 * vpermd each and two rounds of byte/word unpacks give vectors whose dword j holds the four k bytes of row j
 * (8 rows per vector, natural row order, bytes in the order k, k+2, k+1, k+3: x_q's bytes are stored in that order
 * by q4q_chunk on this path). vpmaddubsw (u unsigned, x_q signed) sums byte pairs into int16 without saturation
 * (|2·15·127| = 3810), eight such sums per block add in int16 (at most 30480), and one vpmaddwd by 1 per block
 * widens them to the row's int32 sum; the int32 offset −8·Σ x_q is added after. The GEMV widens in registers;
 * the GEMM widens each 32-row block once into a per-thread buffer (32·K bytes) and runs 4 x rows × 16 outputs
 * tiles over it (int16 sums in registers, the float sums in a small tile in L1).
 *
 * Elsewhere the portable C path runs (the Python side routes such hosts to the ATen path instead). Each path
 * reads the block size of its own build (:c:func:`hf_q4_block`): a torch build that packs another one (the
 * AVX-512 builds seen packed 64-row blocks, which an AVX2-path build here does not read) fails the caller's layout
 * check and keeps ATen's path. */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define HF_Q4A_VNNI 1
#define HF_Q4A_AVX2 0
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define HF_Q4A_VNNI 0
#define HF_Q4A_AVX2 1
#include <immintrin.h>
#else
#define HF_Q4A_VNNI 0
#define HF_Q4A_AVX2 0
#endif

enum { Q4A_PORTABLE = 0, Q4A_VNNI = 1, Q4A_AVX2 = 2 };
#if HF_Q4A_AVX2
#define Q4_BLK 32 /* rows per block of ATen's packed layout (AVX2 builds) */
#else
#define Q4_BLK 64 /* rows per block of ATen's packed layout (AVX-512 builds) */
#endif
#define Q4G_R 6   /* x rows per GEMM tile (VNNI) */
#define Q4G_R2 4  /* x rows per GEMM tile (AVX2) */

/* Rows per block of the packed layout this build's kernels read. */
int hf_q4_block(void) { return Q4_BLK; }

static int q4a_best(void) { return HF_Q4A_VNNI ? Q4A_VNNI : HF_Q4A_AVX2 ? Q4A_AVX2 : Q4A_PORTABLE; }

static _Atomic int q4a_forced = -1; /* test hook: the portable path instead of the best compiled one, or -1 */

/* Force path ``path`` (0 portable; any other value means the best compiled: 1 AVX512-VNNI+VBMI or 2 AVX2 + FMA,
 * a build has one of them), -1 for the best, -2 to leave it; returns the best path this build has. */
int hf_q4a_path(int path) {
    if (path != -2) atomic_store(&q4a_forced, path); /* -2: only ask */
    return q4a_best();
}

static int q4a_path(void) {
    return atomic_load(&q4a_forced) == Q4A_PORTABLE ? Q4A_PORTABLE : q4a_best();
}

typedef struct {
    const uint8_t *w;
    const float *sz, *bias;
    float *y;
    const int8_t *xq;
    const float *xd;
    const int32_t *xc;
    uint8_t *scratch;
    const float *x;
    long m, n, k, group, nb, scratch_bytes, qrows;
    int act, path;
} q4_ctx;

/* x_q, d and c = −8·Σ x_q per block of 32 for x's rows [c*qrows, (c+1)*qrows). */
static void q4q_chunk(void *p, long c) {
    const q4_ctx *a = p;
    long nb = a->nb, k = a->k;
    float xd8[nb * 8 + 16]; /* hf_quantize_q8_blocks' 8x scales (unused here) */
    for (long r = c * a->qrows; r < (c + 1) * a->qrows && r < a->m; r++) {
        int8_t *xq = (int8_t *)a->xq + r * k;
        hf_quantize_q8_blocks(a->x + r * k, k, xq, (float *)a->xd + r * nb, xd8);
        for (long b = 0; b < nb; b++) {
            int32_t s = 0;
            for (int i = 0; i < 32; i++) s += xq[b * 32 + i];
            ((int32_t *)a->xc)[r * nb + b] = -8 * s;
        }
        if (a->path == Q4A_AVX2) /* bytes k, k+2, k+1, k+3 per 4, as the AVX2 path's widened weight holds them */
            for (long i = 0; i < k; i += 4) {
                int8_t t = xq[i + 1];
                xq[i + 1] = xq[i + 2], xq[i + 2] = t;
            }
    }
}

static inline int q4_u(const uint8_t *w, long k, long n, long kk) {
    uint8_t v = w[(n / Q4_BLK) * (Q4_BLK / 2) * k + kk * (Q4_BLK / 2) + n % (Q4_BLK / 2)];
    return n % Q4_BLK < Q4_BLK / 2 ? v & 15 : v >> 4;
}

/* Outputs [n0, n1) of one x row (x_q, d) into yr: the arithmetic above in plain C. */
static void q4_rows_portable(const q4_ctx *a, const int8_t *xq, const float *xd, long n0, long n1, float *yr) {
    long k = a->k, bpg = a->group / 32;
    for (long n = n0; n < n1; n++) {
        float acc = 0.f;
        for (long b = 0; b < a->nb; b++) {
            int32_t dot = 0;
            for (int i = 0; i < 32; i++) dot += (q4_u(a->w, k, n, b * 32 + i) - 8) * (int32_t)xq[b * 32 + i];
            float ds = xd[b] * a->sz[((b / bpg) * a->n + n) * 2];
            acc = acc + ds * (float)dot;
        }
        yr[n] = act_of(a->bias ? acc + a->bias[n] : acc, a->act);
    }
}

/* Four bytes of x_q (a dword to broadcast). */
static inline int32_t q4_x4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The x rows r0..r0+R-1 of a GEMM tile (an edge past the last row repeats it): their x_q, d and offset rows. */
static inline void q4_tile_rows(const q4_ctx *a, long r0, int R, const int8_t **xq, const float **xd,
                                const int32_t **xc, long *rr) {
    for (int i = 0; i < R; i++) {
        rr[i] = r0 + i < a->m ? r0 + i : a->m - 1;
        xq[i] = a->xq + rr[i] * a->k, xd[i] = a->xd + rr[i] * a->nb, xc[i] = a->xc + rr[i] * a->nb;
    }
}

#if HF_Q4A_VNNI
/* vpermt2b indices: dword j of the result holds bytes k..k+3 of packed column i = j (+16 for the second). */
static inline __m512i q4_perm(int second) {
    uint8_t idx[64];
    for (int j = 0; j < 16; j++)
        for (int t = 0; t < 4; t++) idx[4 * j + t] = (uint8_t)((t & 1) * 32 + (t >> 1) * 64 + j + 16 * second);
    return _mm512_loadu_si512((const void *)idx);
}

/* Four k columns (k = 4s..4s+3) of a 64-row block at p: v[i] = u of rows 16i..16i+15, dword per row. */
static inline void q4_unpack4(const uint8_t *p, __m512i ia, __m512i ib, __m512i m, __m512i *v) {
    __m512i l0 = _mm512_loadu_si512((const void *)p), l1 = _mm512_loadu_si512((const void *)(p + 64));
    __m512i lo = _mm512_permutex2var_epi8(l0, ia, l1), hi = _mm512_permutex2var_epi8(l0, ib, l1);
    v[0] = _mm512_and_si512(lo, m), v[1] = _mm512_and_si512(hi, m);
    v[2] = _mm512_and_si512(_mm512_srli_epi16(lo, 4), m), v[3] = _mm512_and_si512(_mm512_srli_epi16(hi, 4), m);
}

/* s[g, n..n+15] from the interleaved (scale, zero) pairs. */
static inline __m512 q4_scales16(const float *sz, long nn, long g, long n) {
    const float *p = sz + (g * nn + n) * 2;
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    return _mm512_permutex2var_ps(_mm512_loadu_ps(p), even, _mm512_loadu_ps(p + 16));
}

/* 16 results (+ bias), act, stored at yr (ReLU/none on the vector, other activations per element). */
static inline void q4_store16(const q4_ctx *a, __m512 v, long n, float *yr) {
    if (a->bias) v = _mm512_add_ps(v, _mm512_loadu_ps(a->bias + n));
    if (a->act == ACT_RELU)
        v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LE_OQ), v, _mm512_setzero_ps());
    _mm512_storeu_ps(yr + n, v);
    if (a->act != ACT_NONE && a->act != ACT_RELU)
        for (int e = 0; e < 16; e++) yr[n + e] = act_of(yr[n + e], a->act);
}
#endif

#if HF_Q4A_AVX2
/* vpermd indices: dwords (c0 rows 0-3, 8-11, c1 rows 0-3, 8-11, c0 rows 4-7, 12-15, c1 rows 4-7, 12-15) of a
 * 32-byte load holding packed columns c0 (bytes 0..15) and c1 (16..31). */
static inline __m256i q4_perm8(void) { return _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7); }

/* Four k columns (k = 4s..4s+3) of a 32-row block at p (64 bytes): v[i] = u of rows 8i..8i+7, dword per row
 * holding columns (k, k+2, k+1, k+3). */
static inline void q4_unpack4x8(const uint8_t *p, __m256i perm, __m256i m, __m256i *v) {
    __m256i p0 = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)p), perm);
    __m256i p1 = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(p + 32)), perm);
    __m256i a = _mm256_unpacklo_epi8(p0, p1), b = _mm256_unpackhi_epi8(p0, p1); /* (c0, c2) / (c1, c3) pairs */
    __m256i d0 = _mm256_unpacklo_epi16(a, b), d1 = _mm256_unpackhi_epi16(a, b);  /* rows 0-7 / 8-15 */
    v[0] = _mm256_and_si256(d0, m), v[1] = _mm256_and_si256(d1, m);
    v[2] = _mm256_and_si256(_mm256_srli_epi16(d0, 4), m), v[3] = _mm256_and_si256(_mm256_srli_epi16(d1, 4), m);
}

/* s[g, n..n+7] from the interleaved (scale, zero) pairs. */
static inline __m256 q4_scales8(const float *sz, long nn, long g, long n) {
    const float *p = sz + (g * nn + n) * 2;
    __m256 e = _mm256_shuffle_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8), 0x88); /* rows 0 1 4 5 | 2 3 6 7 */
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xD8));
}

/* The block's int32 sums of 8 rows: the int16 pair sums widened and added by vpmaddwd, + the −8·Σ x_q offset. */
static inline __m256i q4_dot8(__m256i s16, int32_t c) {
    return _mm256_add_epi32(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)), _mm256_set1_epi32(c));
}

/* acc + (d·s)·(float)dot: three roundings, as every path. */
static inline __m256 q4_fold8(__m256 acc, __m256 d, __m256 s, __m256i dot) {
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(d, s), _mm256_cvtepi32_ps(dot)));
}

/* 8 results (+ bias), act, stored at yr (ReLU/none on the vector, other activations per element). */
static inline void q4_store8(const q4_ctx *a, __m256 v, long n, float *yr) {
    if (a->bias) v = _mm256_add_ps(v, _mm256_loadu_ps(a->bias + n));
    if (a->act == ACT_RELU) v = _mm256_blendv_ps(v, _mm256_setzero_ps(), _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LE_OQ));
    _mm256_storeu_ps(yr + n, v);
    if (a->act != ACT_NONE && a->act != ACT_RELU)
        for (int e = 0; e < 8; e++) yr[n + e] = act_of(yr[n + e], a->act);
}
#endif

/* GEMV chunk c: outputs [Q4_BLK·c, Q4_BLK·(c + 1)) of the one row. */
static void q4v_chunk(void *p, long c) {
    const q4_ctx *a = p;
    long n0 = c * Q4_BLK;
    if (a->path == Q4A_PORTABLE) {
        q4_rows_portable(a, a->xq, a->xd, n0, n0 + Q4_BLK, a->y);
        return;
    }
#if HF_Q4A_AVX2
    long k = a->k, bpg = a->group / 32;
    const uint8_t *w = a->w + n0 * k / 2;
    const __m256i perm = q4_perm8(), m = _mm256_set1_epi8(15);
    __m256 acc[4], sv[4];
    for (int j = 0; j < 4; j++) acc[j] = sv[j] = _mm256_setzero_ps();
    for (long b = 0; b < a->nb; b++) {
        if (b % bpg == 0)
            for (int j = 0; j < 4; j++) sv[j] = q4_scales8(a->sz, a->n, b / bpg, n0 + 8 * j);
        __m256i s16[4], v[4];
        for (int j = 0; j < 4; j++) s16[j] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            q4_unpack4x8(w + (b * 8 + s) * 64, perm, m, v);
            __m256i xb = _mm256_set1_epi32(q4_x4(a->xq + b * 32 + 4 * s));
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) s16[j] = _mm256_add_epi16(s16[j], _mm256_maddubs_epi16(v[j], xb));
        }
        __m256 d = _mm256_set1_ps(a->xd[b]);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) acc[j] = q4_fold8(acc[j], d, sv[j], q4_dot8(s16[j], a->xc[b]));
    }
    for (int j = 0; j < 4; j++) q4_store8(a, acc[j], n0 + 8 * j, a->y);
#endif
#if HF_Q4A_VNNI
    long k = a->k, bpg = a->group / 32;
    const uint8_t *w = a->w + n0 * k / 2;
    const __m512i ia = q4_perm(0), ib = q4_perm(1), m = _mm512_set1_epi8(15);
    __m512 acc[4], sv[4];
    for (int j = 0; j < 4; j++) acc[j] = sv[j] = _mm512_setzero_ps();
    for (long b = 0; b < a->nb; b++) {
        if (b % bpg == 0)
            for (int j = 0; j < 4; j++) sv[j] = q4_scales16(a->sz, a->n, b / bpg, n0 + 16 * j);
        __m512i ai[4], v[4];
        for (int j = 0; j < 4; j++) ai[j] = _mm512_set1_epi32(a->xc[b]);
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            q4_unpack4(w + (b * 8 + s) * 128, ia, ib, m, v);
            __m512i xb = _mm512_set1_epi32(q4_x4(a->xq + b * 32 + 4 * s));
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) ai[j] = _mm512_dpbusd_epi32(ai[j], v[j], xb);
        }
        __m512 d = _mm512_set1_ps(a->xd[b]);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
            acc[j] = _mm512_add_ps(acc[j], _mm512_mul_ps(_mm512_mul_ps(d, sv[j]), _mm512_cvtepi32_ps(ai[j])));
    }
    for (int j = 0; j < 4; j++) q4_store16(a, acc[j], n0 + 16 * j, a->y);
#endif
}

/* GEMM chunk c: outputs [Q4_BLK·c, Q4_BLK·(c + 1)) of every x row. */
static void q4g_chunk(void *p, long c) {
    const q4_ctx *a = p;
    long n0 = c * Q4_BLK, k = a->k, nn = a->n, nb = a->nb;
    if (a->path == Q4A_PORTABLE) {
        for (long r = 0; r < a->m; r++) q4_rows_portable(a, a->xq + r * k, a->xd + r * nb, n0, n0 + Q4_BLK, a->y + r * nn);
        return;
    }
#if HF_Q4A_AVX2
    long bpg = a->group / 32;
    uint8_t *buf = a->scratch + (long)omp_get_thread_num() * a->scratch_bytes;
    float *sc = (float *)(buf + k / 4 * 128); /* [K/G][32] scales */
    const uint8_t *w = a->w + n0 * k / 2;
    const __m256i perm = q4_perm8(), m = _mm256_set1_epi8(15);
    for (long s = 0; s < k / 4; s++) { /* per 4 columns: rows 0-7, 8-15, 16-23, 24-31 */
        __m256i v[4];
        q4_unpack4x8(w + s * 64, perm, m, v);
        for (int j = 0; j < 4; j++) _mm256_store_si256((__m256i *)(buf + s * 128 + 32 * j), v[j]);
    }
    for (long g = 0; g < k / a->group; g++)
        for (int j = 0; j < 4; j++) _mm256_store_ps(sc + g * 32 + 8 * j, q4_scales8(a->sz, nn, g, n0 + 8 * j));
    for (int h = 0; h < 2; h++) { /* outputs 16h..16h+15 */
        for (long r0 = 0; r0 < a->m; r0 += Q4G_R2) {
            const int8_t *xq[Q4G_R2];
            const float *xd[Q4G_R2];
            const int32_t *xc[Q4G_R2];
            long rr[Q4G_R2];
            q4_tile_rows(a, r0, Q4G_R2, xq, xd, xc, rr);
            __attribute__((aligned(32))) float ft[Q4G_R2][16] = {{0}};
            for (long b = 0; b < nb; b++) {
                __m256i s16[Q4G_R2][2];
#pragma GCC unroll 8
                for (int i = 0; i < Q4G_R2; i++) s16[i][0] = s16[i][1] = _mm256_setzero_si256();
                const uint8_t *wp = buf + b * 8 * 128 + 64 * h;
#pragma GCC unroll 8
                for (int s = 0; s < 8; s++) {
                    __m256i w0 = _mm256_load_si256((const __m256i *)(wp + s * 128));
                    __m256i w1 = _mm256_load_si256((const __m256i *)(wp + s * 128 + 32));
#pragma GCC unroll 8
                    for (int i = 0; i < Q4G_R2; i++) {
                        __m256i xb = _mm256_set1_epi32(q4_x4(xq[i] + b * 32 + 4 * s));
                        s16[i][0] = _mm256_add_epi16(s16[i][0], _mm256_maddubs_epi16(w0, xb));
                        s16[i][1] = _mm256_add_epi16(s16[i][1], _mm256_maddubs_epi16(w1, xb));
                    }
                }
                const float *sg = sc + (b / bpg) * 32 + 16 * h;
                __m256 s0 = _mm256_load_ps(sg), s1 = _mm256_load_ps(sg + 8);
#pragma GCC unroll 8
                for (int i = 0; i < Q4G_R2; i++) {
                    __m256 d = _mm256_set1_ps(xd[i][b]);
                    _mm256_store_ps(ft[i], q4_fold8(_mm256_load_ps(ft[i]), d, s0, q4_dot8(s16[i][0], xc[i][b])));
                    _mm256_store_ps(ft[i] + 8, q4_fold8(_mm256_load_ps(ft[i] + 8), d, s1, q4_dot8(s16[i][1], xc[i][b])));
                }
            }
            for (int i = 0; i < Q4G_R2 && r0 + i < a->m; i++) {
                q4_store8(a, _mm256_load_ps(ft[i]), n0 + 16 * h, a->y + rr[i] * nn);
                q4_store8(a, _mm256_load_ps(ft[i] + 8), n0 + 16 * h + 8, a->y + rr[i] * nn);
            }
        }
    }
#endif
#if HF_Q4A_VNNI
    long bpg = a->group / 32, half = k / 4 * 128;
    uint8_t *buf = a->scratch + (long)omp_get_thread_num() * a->scratch_bytes;
    float *sc = (float *)(buf + 2 * half); /* [K/G][64] scales */
    const uint8_t *w = a->w + n0 * k / 2;
    const __m512i ia = q4_perm(0), ib = q4_perm(1), m = _mm512_set1_epi8(15);
    for (long s = 0; s < k / 4; s++) { /* rows 0..31 into the first half, 32..63 into the second */
        __m512i v[4];
        q4_unpack4(w + s * 128, ia, ib, m, v);
        _mm512_store_si512((void *)(buf + s * 128), v[0]), _mm512_store_si512((void *)(buf + s * 128 + 64), v[1]);
        _mm512_store_si512((void *)(buf + half + s * 128), v[2]);
        _mm512_store_si512((void *)(buf + half + s * 128 + 64), v[3]);
    }
    for (long g = 0; g < k / a->group; g++)
        for (int j = 0; j < 4; j++) _mm512_store_ps(sc + g * 64 + 16 * j, q4_scales16(a->sz, nn, g, n0 + 16 * j));
    for (int h = 0; h < 2; h++) {
        const uint8_t *wb = buf + h * half;
        for (long r0 = 0; r0 < a->m; r0 += Q4G_R) {
            const int8_t *xq[Q4G_R];
            const float *xd[Q4G_R];
            const int32_t *xc[Q4G_R];
            long rr[Q4G_R];
            q4_tile_rows(a, r0, Q4G_R, xq, xd, xc, rr);
            __m512 acc[Q4G_R][2];
#pragma GCC unroll 8
            for (int i = 0; i < Q4G_R; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
            for (long b = 0; b < nb; b++) {
                __m512i ai[Q4G_R][2];
#pragma GCC unroll 8
                for (int i = 0; i < Q4G_R; i++) ai[i][0] = ai[i][1] = _mm512_set1_epi32(xc[i][b]);
                const uint8_t *wp = wb + b * 8 * 128;
#pragma GCC unroll 8
                for (int s = 0; s < 8; s++) {
                    __m512i w0 = _mm512_load_si512((const void *)(wp + s * 128));
                    __m512i w1 = _mm512_load_si512((const void *)(wp + s * 128 + 64));
#pragma GCC unroll 8
                    for (int i = 0; i < Q4G_R; i++) {
                        __m512i xb = _mm512_set1_epi32(q4_x4(xq[i] + b * 32 + 4 * s));
                        ai[i][0] = _mm512_dpbusd_epi32(ai[i][0], w0, xb);
                        ai[i][1] = _mm512_dpbusd_epi32(ai[i][1], w1, xb);
                    }
                }
                const float *sg = sc + (b / bpg) * 64 + 32 * h;
                __m512 s0 = _mm512_load_ps(sg), s1 = _mm512_load_ps(sg + 16);
#pragma GCC unroll 8
                for (int i = 0; i < Q4G_R; i++) {
                    __m512 d = _mm512_set1_ps(xd[i][b]);
                    acc[i][0] = _mm512_add_ps(acc[i][0], _mm512_mul_ps(_mm512_mul_ps(d, s0), _mm512_cvtepi32_ps(ai[i][0])));
                    acc[i][1] = _mm512_add_ps(acc[i][1], _mm512_mul_ps(_mm512_mul_ps(d, s1), _mm512_cvtepi32_ps(ai[i][1])));
                }
            }
            for (int i = 0; i < Q4G_R && r0 + i < a->m; i++) {
                q4_store16(a, acc[i][0], n0 + 32 * h, a->y + rr[i] * nn);
                q4_store16(a, acc[i][1], n0 + 32 * h + 16, a->y + rr[i] * nn);
            }
        }
    }
#endif
}

static int q4_shape_ok(long n, long k, long group) {
    return n > 0 && k > 0 && n % Q4_BLK == 0 && group >= 32 && group % 32 == 0 && k % group == 0;
}

/* y[n] = act(Σ_b (d_b·s[g(b), n])·Σ_{k in b} (u[n, k] − 8)·x_q[k] (+ bias[n])) for one fp32 row x (see above);
 * w: ATen's packed int4 [N, K/2], sz: scales_zeros [K/G, N, 2] (zeros 0). On the native pool, 64 rows per
 * chunk. Returns 0, -1 when the scratch cannot be allocated, -2 for a shape outside the kernel (N % 64, G, K). */
int hf_gemv_q4a(const uint8_t *w, const float *sz, const float *x, const float *bias, float *y, long n, long k,
                long group, int act, int threads) {
    if (!q4_shape_ok(n, k, group)) return -2;
    long nb = k / 32;
    int8_t *xq = aligned_alloc(64, (size_t)((k + 63) / 64 * 64));
    float *xd = malloc((size_t)nb * sizeof(float));
    int32_t *xc = malloc((size_t)nb * sizeof(int32_t));
    if (!xq || !xd || !xc) {
        free(xq), free(xd), free(xc);
        return -1;
    }
    q4_ctx a = {w, sz, bias, y, xq, xd, xc, NULL, x, 1, n, k, group, nb, 0, 1, act, q4a_path()};
    q4q_chunk(&a, 0);
    hf_run(q4v_chunk, &a, n / Q4_BLK, clamp_threads(threads));
    free(xq), free(xd), free(xc);
    return 0;
}

/* hf_gemv_q4a for the m rows of x [m, k] (row r of y has hf_gemv_q4a's bits for row r, on every path), on
 * torch's OpenMP team (see hf_run_team); ``act`` as hf_gemm_q8a takes it (ReLU here, others by the caller).
 * Returns 0, -1 (no scratch; y untouched) or -2 (shape). */
int hf_gemm_q4a(const uint8_t *w, const float *sz, const float *x, const float *bias, float *y, long m, long n,
                long k, long group, int act, int threads) {
    if (m <= 0) return 0;
    if (!q4_shape_ok(n, k, group)) return -2;
    threads = clamp_threads(threads);
    long nb = k / 32, per = Q4_BLK * k + (k / group) * Q4_BLK * (long)sizeof(float); /* widened + scales */
    per = (per + 63) / 64 * 64;
    int path = q4a_path();
    int8_t *xq = aligned_alloc(64, (size_t)((m * k + 63) / 64 * 64));
    float *xd = malloc((size_t)(m * nb) * sizeof(float));
    int32_t *xc = malloc((size_t)(m * nb) * sizeof(int32_t));
    uint8_t *scratch = path != Q4A_PORTABLE ? aligned_alloc(64, (size_t)(per * threads)) : NULL;
    if (!xq || !xd || !xc || (path != Q4A_PORTABLE && !scratch)) {
        free(xq), free(xd), free(xc), free(scratch);
        return -1;
    }
    long qrows = m < 8 ? 1 : 8;
    q4_ctx a = {w, sz, bias, y, xq, xd, xc, scratch, x, m, n, k, group, nb, per, qrows, act, path};
    hf_run_team(q4q_chunk, &a, (m + qrows - 1) / qrows, threads);
    hf_run_team(q4g_chunk, &a, n / Q4_BLK, threads);
    free(xq), free(xd), free(xc), free(scratch);
    return 0;
}

/* ---------------------------------------------------------------- bfloat16 one-row kernels (--precision bf16)
 * Why: a bf16 decode step reads half the weight bytes of an fp32 one, but ATen/oneDNN run its one-row
 * products as small GEMMs (dispatch, a per-call reorder check, one thread per call) and its row ops as chains
 * of bf16 ATen kernels. These are the fp32 kernels above on bf16 storage (uint16_t: the top half of an fp32):
 * the same four-stream chunks on the same pool (hf_run), fp32 accumulation, each result rounded to bf16 once,
 * round-to-nearest-even as torch's c10::BFloat16 (and oneDNN) round.
 *
 * Products: a bf16 x bf16 product is exact in fp32 (8 + 8 significant bits), so an FMA and a multiply-then-add
 * round alike, and the paths below give the same bits: each row sums into 16 fp32 lanes, lane l taking, per
 * block of 32 elements, element 2l+1 then element 2l (what AVX512-BF16 ``vdpbf16ps`` does; the AVX-512 path
 * shifts bf16 to fp32 and uses two FMAs in that order; the portable C loop does the same); a partial last
 * block is zero-padded; the 16 lanes are reduced by halves (8, 4, 2, 1). (vdpbf16ps treats denormal inputs
 * and results as zero; the other paths do not: they differ only there.) Rounding of the steps mirrors ATen's
 * bf16 chains: a linear's fp32 sum (+ bias) is rounded, then an activation is computed in fp32 from the
 * rounded value and rounded again (ATen's bf16 ``gelu(linear(x))``). */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

typedef uint16_t hf_bf16;

static inline float bf2f(hf_bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> bf16, round to nearest even; NaN -> 0x7FC0 (c10::BFloat16's round_to_nearest_even). */
static inline hf_bf16 f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7FC0;
    return (hf_bf16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HF_BF16X16 1
/* 16 bf16 values (the masked ones 0) widened to fp32. */
static inline __m512 bf16x16(__mmask16 mk, const hf_bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, p)), 16));
}

/* 16 fp32 values rounded to bf16 as f2bf (nearest even, NaN -> 0x7FC0), as fp32. */
static inline __m512 round_bf16x16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i b = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                                  _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))),
                                 _mm512_set1_epi32((int)0xFFFF0000u));
    b = _mm512_mask_mov_epi32(b, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
    return _mm512_castsi512_ps(b);
}

/* 16 values already rounded to bf16 (round_bf16x16) stored as bf16, the masked ones left alone. */
static inline void store_bf16x16(hf_bf16 *p, __mmask16 mk, __m512 rounded) {
    _mm256_mask_storeu_epi16(p, mk, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
}
#endif


enum { BF16_PORTABLE = 0, BF16_AVX512 = 1, BF16_DPBF16 = 2 };

static int bf16_best(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return BF16_DPBF16;
#elif defined(__AVX512F__) && defined(__AVX512BW__)
    return BF16_AVX512;
#else
    return BF16_PORTABLE;
#endif
}

static _Atomic int bf16_forced = -1; /* test hook: a lower path than the best compiled one, or -1 */

/* Force path ``path`` (0 portable C, 1 AVX-512 shift + FMA, 2 AVX512-BF16 vdpbf16ps; clamped to the best
 * compiled), -1 for the best; returns the best path this build has. */
int hf_bf16_path(int path) {
    atomic_store(&bf16_forced, path);
    return bf16_best();
}

static int bf16_path(void) {
    int p = bf16_best(), f = atomic_load(&bf16_forced);
    return f >= 0 && f < p ? f : p;
}

static float bf16_reduce16(float *acc) {
    for (int h = 8; h >= 1; h /= 2)
        for (int i = 0; i < h; i++) acc[i] += acc[i + h];
    return acc[0];
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* bf16_reduce16 of a vector: the same halving adds (lane i + lane i+8, then +4, +2, +1), so the same bits. */
static inline float bf16_reduce_v(__m512 a) {
    __m256 r8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    __m128 r4 = _mm_add_ps(_mm256_castps256_ps128(r8), _mm256_extractf128_ps(r8, 1));
    __m128 r2 = _mm_add_ps(r4, _mm_movehl_ps(r4, r4));
    return _mm_cvtss_f32(_mm_add_ss(r2, _mm_shuffle_ps(r2, r2, 1)));
}

static inline __m512i bf16_load(const hf_bf16 *p, long i, long k) {
    return i + 32 <= k ? _mm512_loadu_si512((const void *)(p + i))
                       : _mm512_maskz_loadu_epi16((__mmask32)((1ull << (k - i)) - 1), p + i);
}
#endif

/* out[j] = w[j] . x (k elements) for four rows, in the lane order described above. */
static void bf16_dot4(const hf_bf16 *const *w, const hf_bf16 *x, long k, int path, float *out) {
    (void)path;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (path == BF16_DPBF16) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        long i = 0;
        for (; i + 32 <= k; i += 32) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + i));
            HF_PREFETCH(w[0] + i), HF_PREFETCH(w[1] + i), HF_PREFETCH(w[2] + i), HF_PREFETCH(w[3] + i);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512((const void *)(w[0] + i)), xv);
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512((const void *)(w[1] + i)), xv);
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512((const void *)(w[2] + i)), xv);
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512((const void *)(w[3] + i)), xv);
        }
        if (i < k) {
            __m512bh xv = (__m512bh)bf16_load(x, i, k);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)bf16_load(w[0], i, k), xv);
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)bf16_load(w[1], i, k), xv);
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)bf16_load(w[2], i, k), xv);
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)bf16_load(w[3], i, k), xv);
        }
        out[0] = bf16_reduce_v(a0), out[1] = bf16_reduce_v(a1), out[2] = bf16_reduce_v(a2), out[3] = bf16_reduce_v(a3);
        return;
    }
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (path == BF16_AVX512) {
        const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (long i = 0; i < k; i += 32) {
            __m512i xv = bf16_load(x, i, k);
            HF_PREFETCH(w[0] + i), HF_PREFETCH(w[1] + i), HF_PREFETCH(w[2] + i), HF_PREFETCH(w[3] + i);
            __m512 xo = _mm512_castsi512_ps(_mm512_and_si512(xv, hi)), xe = _mm512_castsi512_ps(_mm512_slli_epi32(xv, 16));
#define HF_BF16_FMA2(j, aj)                                                                                    \
    {                                                                                                          \
        __m512i wv = bf16_load(w[j], i, k);                                                                    \
        aj = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(wv, hi)), xo, aj);                           \
        aj = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(wv, 16)), xe, aj);                          \
    }
            HF_BF16_FMA2(0, a0) HF_BF16_FMA2(1, a1) HF_BF16_FMA2(2, a2) HF_BF16_FMA2(3, a3)
#undef HF_BF16_FMA2
        }
        out[0] = bf16_reduce_v(a0), out[1] = bf16_reduce_v(a1), out[2] = bf16_reduce_v(a2), out[3] = bf16_reduce_v(a3);
        return;
    }
#endif
    float acc[4][16];
    memset(acc, 0, sizeof acc);
    for (long i = 0; i < k; i += 32)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 16; l++) {
                long io = i + 2 * l + 1, ie = i + 2 * l;
                float po = io < k ? bf2f(w[j][io]) * bf2f(x[io]) : 0.f;
                acc[j][l] += po;
                float pe = ie < k ? bf2f(w[j][ie]) * bf2f(x[ie]) : 0.f;
                acc[j][l] += pe;
            }
    for (int j = 0; j < 4; j++) out[j] = bf16_reduce16(acc[j]);
}

/* A linear's output element: round(sum (+ bias)), then act computed from the rounded value and rounded. */
static inline hf_bf16 bf16_out(float v, const hf_bf16 *bias, long r, int act) {
    hf_bf16 o = f2bf(bias ? v + bf2f(bias[r]) : v);
    return act == ACT_NONE ? o : f2bf(act_of(bf2f(o), act));
}

typedef struct {
    const hf_bf16 *w, *x, *bias;
    hf_bf16 *y;
    float *part;
    long n, k, rows;
    int act, chunks, path;
    const hf_bf16 *res; /* a residual added to the rounded output (ATen's bf16 add after it), or NULL */
} bgemv_ctx;

static inline hf_bf16 bf16_res(hf_bf16 o, const hf_bf16 *res, long r) {
    return res ? f2bf(bf2f(o) + bf2f(res[r])) : o;
}

/* Chunk c of y = act(W x + b), W bf16 [N, K]: four streams (one per quarter of the rows), as nk_chunk. */
static void bf16_nk_chunk(void *p, long c) {
    const bgemv_ctx *a = p;
    long n = a->n, k = a->k, q = n / 4, i0 = c * a->rows, i1 = i0 + a->rows < q ? i0 + a->rows : q;
    float o[4];
    if (i0 >= q) { /* the n % 4 tail rows */
        for (long r = 4 * q; r < n; r++) {
            const hf_bf16 *w[4] = {a->w + r * k, a->w + r * k, a->w + r * k, a->w + r * k};
            bf16_dot4(w, a->x, k, a->path, o);
            a->y[r] = bf16_res(bf16_out(o[0], a->bias, r, a->act), a->res, r);
        }
        return;
    }
    for (long i = i0; i < i1; i++) {
        const hf_bf16 *w[4] = {a->w + i * k, a->w + (i + q) * k, a->w + (i + 2 * q) * k, a->w + (i + 3 * q) * k};
        bf16_dot4(w, a->x, k, a->path, o);
        for (int j = 0; j < 4; j++)
            a->y[i + j * q] = bf16_res(bf16_out(o[j], a->bias, i + j * q, a->act), a->res, i + j * q);
    }
}

/* Split-K part c of a bf16 W [K, N] (four streams over quarters of K, as kn_partial) into row c of the fp32
 * ``part``. Plain C (vectorized by the compiler): every product is exact, so the sums do not depend on it. */
static void bf16_kn_partial(void *p, long c) {
    const bgemv_ctx *a = p;
    long n = a->n, q = a->k / 4, r = (q + a->chunks - 1) / a->chunks;
    long i0 = c * r < q ? c * r : q, i1 = i0 + r < q ? i0 + r : q;
    float *restrict acc = a->part + (size_t)c * n;
    memset(acc, 0, (size_t)n * sizeof(float));
    for (long i = i0; i < i1; i++) {
        const float x0 = bf2f(a->x[i]), x1 = bf2f(a->x[i + q]), x2 = bf2f(a->x[i + 2 * q]), x3 = bf2f(a->x[i + 3 * q]);
        const hf_bf16 *restrict w0 = a->w + i * n, *restrict w1 = w0 + q * n;
        const hf_bf16 *restrict w2 = w1 + q * n, *restrict w3 = w2 + q * n;
        long j = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        /* the C line below, 16 columns at a time (an FMA onto an exact product rounds as the add does) */
        const __m512 v0 = _mm512_set1_ps(x0), v1 = _mm512_set1_ps(x1), v2 = _mm512_set1_ps(x2), v3 = _mm512_set1_ps(x3);
#define HF_BF16_W(wp) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((wp) + j))), 16))
        for (; j + 16 <= n; j += 16) {
            HF_PREFETCH(w0 + j), HF_PREFETCH(w1 + j), HF_PREFETCH(w2 + j), HF_PREFETCH(w3 + j);
            __m512 t01 = _mm512_fmadd_ps(v1, HF_BF16_W(w1), _mm512_mul_ps(v0, HF_BF16_W(w0)));
            __m512 t23 = _mm512_fmadd_ps(v3, HF_BF16_W(w3), _mm512_mul_ps(v2, HF_BF16_W(w2)));
            _mm512_storeu_ps(acc + j, _mm512_add_ps(_mm512_loadu_ps(acc + j), _mm512_add_ps(t01, t23)));
        }
#undef HF_BF16_W
#endif
        for (; j < n; j++) acc[j] += (x0 * bf2f(w0[j]) + x1 * bf2f(w1[j])) + (x2 * bf2f(w2[j]) + x3 * bf2f(w3[j]));
    }
    if (c == a->chunks - 1)
        for (long i = 4 * q; i < a->k; i++) {
            const float xi = bf2f(a->x[i]);
            const hf_bf16 *restrict wr = a->w + i * n;
#pragma omp simd
            for (long j = 0; j < n; j++) acc[j] += xi * bf2f(wr[j]);
        }
}

static void bf16_kn_reduce(void *p, long c) {
    const bgemv_ctx *a = p;
    long n = a->n, j0 = c * HF_COLS, j1 = j0 + HF_COLS < n ? j0 + HF_COLS : n;
    float s[HF_COLS];
    for (long j = j0; j < j1; j++) s[j - j0] = a->part[j];
    for (int cc = 1; cc < a->chunks; cc++) {
        const float *restrict pc = a->part + (size_t)cc * n;
#pragma omp simd
        for (long j = j0; j < j1; j++) s[j - j0] += pc[j];
    }
    for (long j = j0; j < j1; j++) a->y[j] = bf16_res(bf16_out(s[j - j0], a->bias, j, a->act), a->res, j);
}

/* y = act(x·Wᵀ + b) for one bf16 row: W bf16 [N, K] (weight_t = 0, F.linear layout) or [K, N] (weight_t = 1,
 * addmm / Conv1D layout: split-K into ``slots`` fp32 partial rows of ``part`` [slots, N], summed in part
 * order, so the result depends on neither the thread count nor timing); bias bf16 [N] or NULL; y bf16 [N]. */
static void gemv_bf16_res(const hf_bf16 *w, const hf_bf16 *x, const hf_bf16 *bias, const hf_bf16 *res, hf_bf16 *y,
                          long n, long k, int weight_t, int act, int threads, float *part, int slots) {
    threads = clamp_threads(threads);
    if (weight_t) {
        int chunks = kn_parts(k, slots);
        bgemv_ctx a = {w, x, bias, y, part, n, k, 0, act, chunks, 0, res};
        hf_run(bf16_kn_partial, &a, chunks, threads);
        hf_run(bf16_kn_reduce, &a, (n + HF_COLS - 1) / HF_COLS, threads);
    } else {
        bgemv_ctx a = {w, x, bias, y, 0, n, k, rows_per_chunk(k * 2), act, 0, bf16_path(), res};
        hf_run(bf16_nk_chunk, &a, four_stream_chunks(n, a.rows), threads);
    }
}

void hf_gemv_bf16(const hf_bf16 *w, const hf_bf16 *x, const hf_bf16 *bias, hf_bf16 *y, long n, long k,
                  int weight_t, int act, int threads, float *part, int slots) {
    gemv_bf16_res(w, x, bias, 0, y, n, k, weight_t, act, threads, part, slots);
}

/* hf_gemv_bf16 with the residual add after it: y = round(round(act(..)) + res), ATen's bf16 add after the
 * product, bit for bit (``res`` may be ``y``; ``x`` must not overlap ``y``; see hf_gemv_res). */
void hf_gemv_bf16_res(const hf_bf16 *w, const hf_bf16 *x, const hf_bf16 *bias, const hf_bf16 *res, hf_bf16 *y,
                      long n, long k, int weight_t, int act, int threads, float *part, int slots) {
    gemv_bf16_res(w, x, bias, res, y, n, k, weight_t, act, threads, part, slots);
}

/* ---- bf16 products of several rows on AMX tiles (a prompt's products) ----
 * y = x·Wᵀ + b for M bf16 rows of K, W bf16 [N, K] (or [K, N]) packed once by hf_pack_amx_bf16 into AMX B tiles:
 * per block of 16 output columns, per 32 elements of K, one 1 KiB tile of 16 rows of 16 (column, k pair)
 * elements (the VNNI layout ``tdpbf16ps`` reads; past N and K zero), the column blocks' tiles contiguous along K.
 * A task is a group of AMX_CB column blocks: AMX_CB weight streams, as the GEMVs read theirs, prefetched AMX_PF
 * bytes ahead, into AMX_CB accumulator tiles per 16 rows of x (the group's tiles are read again from L2 for the
 * next 16 rows; one stream in the order of reading, and prefetching further ahead, were slower). x is
 * copied once per call into a zero-padded [M16, K32] scratch (tiles load whole rows). Each output is the fp32 sum
 * (+ bias) rounded once to bf16. Why: oneDNN's bf16 GEMM read its weights from memory well below the rate the GEMVs
 * reach at the row counts of a prompt (docs/bench/bf16_rows.md); AMX has the compute to keep up with the stream.
 * Returns -3 where AMX is not built or the OS refuses it (the caller keeps oneDNN), -1 without scratch memory. */
#define AMX_CB 4
#ifndef AMX_PF
#define AMX_PF 2048 /* bytes ahead of each weight stream the AMX kernel prefetches */
#endif
#define AMX_KEEP ((size_t)8 << 20)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define HF_AMX 1
#endif

static _Atomic int amx_state = 0; /* 0 unknown, 1 usable, -1 not */

static int amx_ok(void) {
    int st = atomic_load(&amx_state);
    if (st) return st > 0;
#ifdef HF_AMX
    /* the kernel lets a process use the AMX tile data only after asking (ARCH_REQ_XCOMP_PERM, XTILEDATA) */
    st = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
#else
    st = -1;
#endif
    atomic_store(&amx_state, st);
    return st > 0;
}

int hf_amx_bf16_ok(void) { return amx_ok(); }

/* W (bf16 [N, K], or [K, N] when weight_t) into the tile layout above; out holds ceil(N/16) * ceil(K/32) * 512
 * bf16 elements. */
void hf_pack_amx_bf16(const hf_bf16 *w, hf_bf16 *out, long n, long k, int weight_t) {
    long nb = (n + 15) / 16, kb = (k + 31) / 32;
#pragma omp parallel for schedule(static)
    for (long j = 0; j < nb; j++)
        for (long t = 0; t < kb; t++) {
            hf_bf16 *tile = out + ((size_t)j * kb + t) * 512;
            for (long r = 0; r < 16; r++)
                for (long c = 0; c < 16; c++)
                    for (long e = 0; e < 2; e++) {
                        long col = 16 * j + c, kk = 32 * t + 2 * r + e;
                        tile[r * 32 + 2 * c + e] = col < n && kk < k ? (weight_t ? w[kk * n + col] : w[col * k + kk]) : 0;
                    }
        }
}

typedef struct {
    const hf_bf16 *wp, *xp, *bias; /* packed weight, padded x [m16][k32] */
    hf_bf16 *y;
    long m, n, k32, nb, kb;
    int act;                  /* the epilogue (amx_store): ACT_*, then */
    const hf_bf16 *mul, *res; /* times mul[r, c], then plus res[r, c] ([m, n] dense; NULL: none) */
} amx_ctx;

#ifdef HF_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

/* Rows [m0, m0 + 16) x columns of nj blocks from 16 * j0 of the fp32 tile results in cbuf (row stride ld floats):
 * + bias, rounded to bf16 as f2bf (nearest even, NaN -> 0x7FC0), then the epilogue (act, times mul, plus res:
 * ATen's bf16 ops after a product, each rounded), 16 columns at a time, into y. */
static void amx_store(const amx_ctx *a, const float *cbuf, long ld, long m0, long c0, long nj) {
    long rows = a->m - m0 < 16 ? a->m - m0 : 16, c1 = c0 + 16 * nj < a->n ? c0 + 16 * nj : a->n;
    for (long r = 0; r < rows; r++)
        for (long c = c0; c < c1; c += 16) {
            __mmask16 mk = mask16(c1 - c);
            __m512 v = _mm512_loadu_ps(cbuf + r * ld + (c - c0));
            if (a->bias) v = _mm512_add_ps(v, bf16x16(mk, a->bias + c));
            if (a->act || a->mul || a->res) { /* ATen's ops after the product, each rounded to bf16 */
                v = round_bf16x16(v);
                if (a->act) v = round_bf16x16(act16(v, a->act));
                if (a->mul) v = round_bf16x16(_mm512_mul_ps(v, bf16x16(mk, a->mul + (m0 + r) * a->n + c)));
                if (a->res) v = _mm512_add_ps(v, bf16x16(mk, a->res + (m0 + r) * a->n + c));
            }
            store_bf16x16(a->y + (m0 + r) * a->n + c, mk, round_bf16x16(v));
        }
}

static void amx_config(void) {
    amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* More than 16 rows: two blocks of 16 rows against two column blocks at a time (2 x 2 accumulators), so each weight
 * tile loaded feeds two products; the group's column pairs in turn, its tiles read from memory on the first pass
 * over the rows and from L2 after. */
static void amx_task2(void *p, long g) {
    const amx_ctx *a = p;
    amx_config();
    long j0 = g * AMX_CB, nj = a->nb - j0 < AMX_CB ? a->nb - j0 : AMX_CB;
    size_t bstride = (size_t)a->kb * 512;
    float cbuf[32 * 32] __attribute__((aligned(64)));
    for (long m0 = 0; m0 < a->m; m0 += 32)
        for (long jp = 0; jp < nj; jp += 2) {
            const hf_bf16 *B = a->wp + (size_t)(j0 + jp) * bstride, *A = a->xp + m0 * a->k32;
            int two = jp + 1 < nj;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (long t = 0; t < a->kb; t++) {
                const hf_bf16 *bt = B + (size_t)t * 512;
                if (m0 == 0)
                    for (long j = 0; j <= two; j++)
                        for (int l = 0; l < 1024; l += 64)
                            _mm_prefetch((const char *)(bt + j * bstride) + AMX_PF + l, _MM_HINT_T0);
                _tile_loadd(4, A + 32 * t, a->k32 * 2);
                _tile_loadd(5, A + 16 * a->k32 + 32 * t, a->k32 * 2);
                _tile_loadd(6, bt, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(2, 5, 6);
                if (two) {
                    _tile_loadd(7, bt + bstride, 64);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, cbuf, 32 * 4);
            _tile_stored(2, cbuf + 16 * 32, 32 * 4);
            if (two) {
                _tile_stored(1, cbuf + 16, 32 * 4);
                _tile_stored(3, cbuf + 16 * 32 + 16, 32 * 4);
            }
            amx_store(a, cbuf, 32, m0, 16 * (j0 + jp), 1 + two);
            if (m0 + 16 < a->m) amx_store(a, cbuf + 16 * 32, 32, m0 + 16, 16 * (j0 + jp), 1 + two);
        }
    _tile_release();
}

static void amx_task(void *p, long g) {
    const amx_ctx *a = p;
    amx_config();
    long j0 = g * AMX_CB, nj = a->nb - j0 < AMX_CB ? a->nb - j0 : AMX_CB;
    const hf_bf16 *B = a->wp + (size_t)j0 * a->kb * 512;
    size_t bstride = (size_t)a->kb * 512; /* elements between two column blocks' tiles */
    float cbuf[16 * 16 * AMX_CB] __attribute__((aligned(64)));
    for (long m0 = 0; m0 < a->m; m0 += 16) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const hf_bf16 *A = a->xp + m0 * a->k32;
        for (long t = 0; t < a->kb; t++) {
            const hf_bf16 *bt = B + (size_t)t * 512;
            if (m0 == 0)
                for (long j = 0; j < nj; j++)
                    for (int l = 0; l < 1024; l += 64) _mm_prefetch((const char *)(bt + j * bstride) + AMX_PF + l, _MM_HINT_T0);
            _tile_loadd(4, A + 32 * t, a->k32 * 2);
            _tile_loadd(5, bt, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (nj > 1) { _tile_loadd(6, bt + bstride, 64); _tile_dpbf16ps(1, 4, 6); }
            if (nj > 2) { _tile_loadd(7, bt + 2 * bstride, 64); _tile_dpbf16ps(2, 4, 7); }
            if (nj > 3) { _tile_loadd(5, bt + 3 * bstride, 64); _tile_dpbf16ps(3, 4, 5); }
        }
        _tile_stored(0, cbuf, 16 * 4 * AMX_CB);
        if (nj > 1) _tile_stored(1, cbuf + 16, 16 * 4 * AMX_CB);
        if (nj > 2) _tile_stored(2, cbuf + 32, 16 * 4 * AMX_CB);
        if (nj > 3) _tile_stored(3, cbuf + 48, 16 * 4 * AMX_CB);
        amx_store(a, cbuf, 16 * AMX_CB, m0, 16 * j0, nj);
    }
    _tile_release();
}
#endif

int hf_gemm_amx_bf16(const hf_bf16 *wp, const hf_bf16 *x, const hf_bf16 *bias, hf_bf16 *y, long m, long n, long k,
                     int threads, int act, const hf_bf16 *mul, const hf_bf16 *res) {
    if (m < 1 || !amx_ok()) return m < 1 ? -2 : -3;
    if (!hf_epilogue_act(act)) return -4;
#ifdef HF_AMX
    long k32 = (k + 31) / 32 * 32, m16 = m > 16 ? (m + 31) / 32 * 32 : 16; /* x rows padded for the tiles */
    size_t need = (size_t)m16 * k32 * sizeof(hf_bf16);
    static _Thread_local hf_scratch kept;
    hf_bf16 *xp = scratch_get(&kept, need, AMX_KEEP);
    if (!xp) return -1;
    for (long r = 0; r < m16; r++) {
        hf_bf16 *dst = xp + r * k32;
        if (r < m) {
            memcpy(dst, x + r * k, k * sizeof(hf_bf16));
            memset(dst + k, 0, (k32 - k) * sizeof(hf_bf16));
        } else {
            memset(dst, 0, k32 * sizeof(hf_bf16));
        }
    }
    amx_ctx a = {wp, xp, bias, y, m, n, k32, (n + 15) / 16, k32 / 32, act, mul, res};
    hf_run(m > 16 ? amx_task2 : amx_task, &a, (a.nb + AMX_CB - 1) / AMX_CB, clamp_threads(threads));
    scratch_done(&kept, xp);
    return 0;
#else
    (void)wp, (void)x, (void)bias, (void)y, (void)n, (void)k, (void)threads, (void)mul, (void)res;
    return -3;
#endif
}

/* ---- bf16 products of a few rows on AVX512-BF16 (vdpbf16ps): hf_gemm_bf16_panel ----
 * Y[m, n] = X[m, k] W^T (+ b), then the epilogue amx_store has (act, times mul, plus res, each rounded to bf16 as
 * ATen's ops), for a CPU with AVX512-BF16 and no AMX. Why: a short prompt's bf16 products read every weight from
 * memory once, and oneDNN's kernel at these row counts reads them well below the memory's rate (measured rates:
 * docs/arch/runtime.md). The weight is packed once into panels of HF_BNB columns, k-pair by
 * k-pair (P[j][kp][c][2] = W[j*HF_BNB + c][2kp .. 2kp+1], zero past n and k), so one vdpbf16ps takes 16 columns'
 * pair for one row, X's pair broadcast. X is packed per call by groups of HF_BMR rows, pair by pair, so a step's
 * broadcasts read one line. As in the fp32 panel GEMM (its header has the reasons), a panel's k-pairs are read as
 * HF_BSTREAMS interleaved streams, in blocks that every row group runs over while they are in L1, and the prefetch
 * keeps memory busy while the arithmetic runs: one group fetches HF_BPF bytes ahead into L1 and HF_BPF1 into L2;
 * with several, group g fetches every ng-th step of the next block into L1 and HF_BPF2 bytes ahead into L2, so the
 * next block streams in while every group computes. Each output is one fp32 chain over the k-pairs in
 * that stream-interleaved order (the instruction's own rounding of its two products and sum), then + bias, then the
 * epilogue: the same bits for any thread count. k must be even (X's pairs are read in place). */
#ifndef HF_BNV
#define HF_BNV 3
#endif
#ifndef HF_BMR
#define HF_BMR 8
#endif
#define HF_BNB (16 * HF_BNV)
typedef struct {
    const hf_bf16 *wp, *x, *bias; /* x: X's pairs packed by row group (panel_pack_x) */
    hf_bf16 *y;
    long m, n, k, kp, np, nc;
    int act;
    const hf_bf16 *mul, *res;
} bpanel_ctx;

/* Pack W ([n, k] rows, or [k, n] when weight_t) into hf_gemm_bf16_panel's panels at p (ceil(n / HF_BNB) panels of
 * ceil(k / 2) x HF_BNB x 2 values). */
void hf_pack_bf16_panels(const hf_bf16 *w, hf_bf16 *p, long n, long k, int weight_t) {
    long np = (n + HF_BNB - 1) / HF_BNB, kp = (k + 1) / 2;
    for (long j = 0; j < np; j++)
        for (long i = 0; i < kp; i++) {
            hf_bf16 *dst = p + ((size_t)j * kp + i) * HF_BNB * 2;
            for (long c = 0; c < HF_BNB; c++)
                for (int h = 0; h < 2; h++) {
                    long col = j * HF_BNB + c, kk = 2 * i + h;
                    dst[2 * c + h] = col < n && kk < k ? (weight_t ? w[kk * n + col] : w[col * k + kk]) : 0;
                }
        }
}

/* Whether this build has hf_gemm_bf16_panel's vector path (AVX512-BF16). */
int hf_bf16_panel_ok(void) {
#if defined(__AVX512BF16__) && defined(HF_BF16X16)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__) && defined(HF_BF16X16)
#define HF_BPF 2048  /* one row group: bytes of panel fetched into L1 ahead of its reads */
#define HF_BPF1 8192 /* one row group: bytes of panel fetched into L2 ahead of its reads */
#define HF_BPF2 12288 /* several row groups: bytes ahead that their L2 fetches run (a fixed distance, not a count
                       * of blocks, which for the 24 KiB blocks was slower: docs/arch/runtime.md) */
#define HF_BSTREAMS 4 /* the panel's k-pairs as this many interleaved streams (as the fp32 panel GEMM's) */
/* A panel k-pair step (HF_BNB columns' pairs: three lines) at f into L1. */
static inline void bpanel_prefetch(const char *f) {
    _mm_prefetch(f, _MM_HINT_T0);
    _mm_prefetch(f + 64, _MM_HINT_T0);
    _mm_prefetch(f + 128, _MM_HINT_T0);
}

/* Row group xg (its HF_BMR rows' pairs packed pair by pair: xg[i * HF_BMR + r]) over the k-pairs [i0, i1) of panel
 * pan: MR x 3 accumulators from acc (zero when first), back into acc (HF_BNB floats a row). Prefetch (as the fp32
 * panel GEMM's, see its header): one group fetches HF_BPF bytes ahead of its reads; with ng groups, group g takes
 * every ng-th step from i0 + g and fetches that step of the next block (kb steps on), so the next block streams in
 * while every group computes, not only while the first does (which alone prefetched in session 38's version: the
 * later groups ran from L1 with memory idle). */
static inline __attribute__((always_inline)) void bpanel_block(const int32_t *xg, const hf_bf16 *pan, long i0,
                                                               long i1, long q, long kp, float *acc, int first,
                                                               int g, int ng, long kb, const int MR) {
    __m512 c[HF_BMR][HF_BNV];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < HF_BNV; v++)
            c[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + r * HF_BNB + 16 * v);
    long pfi = i0 + g;
    const long pfo = kb * HF_BNB * 2 * (long)sizeof(hf_bf16);
    for (long i = i0; i < i1; i++) {
        int pf = ng == 1 || i == pfi;
        if (i == pfi) pfi += ng;
        for (int st = 0; st < HF_BSTREAMS; st++) {
            long kk = st * q + i;
            if (kk >= kp) break;
            const hf_bf16 *b = pan + (size_t)kk * HF_BNB * 2;
            if (pf) {
                bpanel_prefetch((const char *)b + (ng == 1 ? HF_BPF : pfo));
                const char *f2 = (const char *)b + (ng == 1 ? HF_BPF1 : HF_BPF2);
                _mm_prefetch(f2, _MM_HINT_T1), _mm_prefetch(f2 + 64, _MM_HINT_T1), _mm_prefetch(f2 + 128, _MM_HINT_T1);
            }
            __m512i bv[HF_BNV];
            for (int v = 0; v < HF_BNV; v++) {
                bv[v] = _mm512_loadu_si512((const void *)(b + 32 * v));
                __asm__("" : "+v"(bv[v])); /* one load each, as panel_step */
            }
            const int32_t *xs = xg + kk * HF_BMR;
            for (int r = 0; r < MR; r++) {
                __m512bh xb = (__m512bh)_mm512_set1_epi32(xs[r]);
                for (int v = 0; v < HF_BNV; v++) c[r][v] = _mm512_dpbf16_ps(c[r][v], (__m512bh)bv[v], xb);
            }
        }
    }
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < HF_BNV; v++) _mm512_storeu_ps(acc + r * HF_BNB + 16 * v, c[r][v]);
}

/* The sums of rows [r0, r0 + mr) of panel j (acc) + bias, through the epilogue into Y. */
static void bpanel_store(const bpanel_ctx *a, long j, long r0, int mr, const float *acc) {
    long c0 = j * HF_BNB;
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < HF_BNV; v++) {
            long c = c0 + 16 * v;
            if (c >= a->n) break;
            __mmask16 mk = mask16(a->n - c);
            __m512 o = _mm512_loadu_ps(acc + r * HF_BNB + 16 * v);
            if (a->bias) o = _mm512_add_ps(o, bf16x16(mk, a->bias + c));
            long at = (r0 + r) * a->n + c;
            if (a->act || a->mul || a->res) { /* ATen's ops after the product, each rounded to bf16 (amx_store) */
                o = round_bf16x16(o);
                if (a->act) o = round_bf16x16(act16(o, a->act));
                if (a->mul) o = round_bf16x16(_mm512_mul_ps(o, bf16x16(mk, a->mul + at)));
                if (a->res) o = _mm512_add_ps(o, bf16x16(mk, a->res + at));
            }
            store_bf16x16(a->y + at, mk, round_bf16x16(o));
        }
}

/* steps per block (HF_BSTREAMS k-pairs each), in L1 while every row group runs over it: 6 KiB for one or two groups
 * (the next block is fetched into L1 beside it), 24 KiB for more (fewer saves and reloads of the sums, as the fp32
 * panel GEMM's HF_PKB; one-off hot-cache timings in docs/arch/runtime.md) */
#define HF_BKB 8
#define HF_BKB_MANY 32
#define HF_BSUP 64  /* rows whose sums a chunk keeps at once (larger m: in turn) */

static void bpanel_chunk(void *ctx, long c) {
    const bpanel_ctx *a = ctx;
    long j0 = c * a->np / a->nc, j1 = (c + 1) * a->np / a->nc;
    const int32_t *xp = (const int32_t *)a->x;
    float acc[HF_BSUP * HF_BNB] __attribute__((aligned(64)));
    for (long j = j0; j < j1; j++) {
        const hf_bf16 *pan = a->wp + (size_t)j * a->kp * HF_BNB * 2;
        for (long s0 = 0; s0 < a->m; s0 += HF_BSUP) {
            long ms = a->m - s0 < HF_BSUP ? a->m - s0 : HF_BSUP;
            int ng = (int)((ms + HF_BMR - 1) / HF_BMR);
            long q = (a->kp + HF_BSTREAMS - 1) / HF_BSTREAMS, kb = ng <= 2 ? HF_BKB : HF_BKB_MANY;
            for (long i0 = 0; i0 < q; i0 += kb) {
                long i1 = i0 + kb < q ? i0 + kb : q;
                for (int g = 0; g < ng; g++) {
                    long r0 = (long)g * HF_BMR;
                    float *ac = acc + r0 * HF_BNB;
                    const int32_t *xg = xp + (s0 + r0) / HF_BMR * a->kp * HF_BMR;
                    int f = i0 == 0;
                    switch (ms - r0 < HF_BMR ? (int)(ms - r0) : HF_BMR) {
                    case 1: bpanel_block(xg, pan, i0, i1, q, a->kp, ac, f, g, ng, kb, 1); break;
                    case 2: bpanel_block(xg, pan, i0, i1, q, a->kp, ac, f, g, ng, kb, 2); break;
                    case 3: bpanel_block(xg, pan, i0, i1, q, a->kp, ac, f, g, ng, kb, 3); break;
                    case 4: bpanel_block(xg, pan, i0, i1, q, a->kp, ac, f, g, ng, kb, 4); break;
                    case 5: bpanel_block(xg, pan, i0, i1, q, a->kp, ac, f, g, ng, kb, 5); break;
                    case 6: bpanel_block(xg, pan, i0, i1, q, a->kp, ac, f, g, ng, kb, 6); break;
                    case 7: bpanel_block(xg, pan, i0, i1, q, a->kp, ac, f, g, ng, kb, 7); break;
                    default: bpanel_block(xg, pan, i0, i1, q, a->kp, ac, f, g, ng, kb, 8); break;
                    }
                }
            }
            for (long r0 = 0; r0 < ms; r0 += HF_BMR)
                bpanel_store(a, j, s0 + r0, ms - r0 < HF_BMR ? (int)(ms - r0) : HF_BMR, acc + r0 * HF_BNB);
        }
    }
}

/* X's pairs packed as panel_pack_x packs fp32 rows (a pair is 4 bytes, as a float; the values only move):
 * xp[(g * kp + i) * HF_BMR + r] = pair i of row g * HF_BMR + r, zero past m, so a step's broadcasts read one line. */
static void panel_pack_x(const float *x, float *xp, long m, long k, int threads);
#endif

/* Y = X W^T + b (b may be NULL), then act, times mul, plus res (0 / NULL: none), on panels made by
 * hf_pack_bf16_panels; X [m, k] (k even), Y, mul and res [m, n] dense bf16 rows. Returns 0, -2 for no rows, -3
 * when this build has no AVX512-BF16 path, -4 for an act the epilogue does not have, -5 for an odd k, -1 when the
 * scratch for X's packed pairs cannot be allocated. */
int hf_gemm_bf16_panel(const hf_bf16 *wp, const hf_bf16 *x, const hf_bf16 *bias, hf_bf16 *y, long m, long n, long k,
                       int threads, int act, const hf_bf16 *mul, const hf_bf16 *res) {
    if (m < 1) return -2;
    if (!hf_bf16_panel_ok()) return -3;
    if (!hf_epilogue_act(act)) return -4;
    if (k % 2) return -5;
#if defined(__AVX512BF16__) && defined(HF_BF16X16)
    threads = clamp_threads(threads);
    long np = (n + HF_BNB - 1) / HF_BNB, nc = threads * ((np + threads * 4 - 1) / (threads * 4)), kp = k / 2;
    size_t xbytes = sizeof(int32_t) * (size_t)((m + HF_BMR - 1) / HF_BMR) * HF_BMR * kp;
    static _Thread_local hf_scratch kept; /* X's packed pairs: kept up to 1 MiB (a short prompt's) */
    int32_t *xp = scratch_get(&kept, xbytes, (size_t)1 << 20);
    if (!xp) return -1;
    panel_pack_x((const float *)x, (float *)xp, m, kp, threads);
    bpanel_ctx a = {wp, (const hf_bf16 *)xp, bias, y, m, n, k, kp, np, nc < np ? nc : np, act, mul, res};
    hf_run_team(bpanel_chunk, &a, a.nc, threads);
    scratch_done(&kept, xp);
#else
    (void)wp, (void)x, (void)bias, (void)y, (void)n, (void)threads, (void)mul, (void)res;
#endif
    return 0;
}

typedef struct {
    const hf_bf16 *x, *wg, *wu;
    hf_bf16 *h;
    long f, d, rows;
    int act, path;
} bgated_ctx;

/* h = round(round(act(round(Wg·x))) * round(Wu·x)): ATen's bf16 ``act(linear) * linear``, rounding for rounding. */
static inline hf_bf16 bf16_gate(float g, float u, int act) {
    return f2bf(bf2f(f2bf(act_of(bf2f(f2bf(g)), act))) * bf2f(f2bf(u)));
}

static void bf16_gated_chunk(void *p, long c) {
    const bgated_ctx *a = p;
    long d = a->d, q = a->f / 2, i0 = c * a->rows, i1 = i0 + a->rows < q ? i0 + a->rows : q;
    float o[4];
    if (i0 >= q) {
        for (long i = 2 * q; i < a->f; i++) {
            const hf_bf16 *w[4] = {a->wg + i * d, a->wu + i * d, a->wg + i * d, a->wu + i * d};
            bf16_dot4(w, a->x, d, a->path, o);
            a->h[i] = bf16_gate(o[0], o[1], a->act);
        }
        return;
    }
    for (long i = i0; i < i1; i++) {
        const hf_bf16 *w[4] = {a->wg + i * d, a->wg + (i + q) * d, a->wu + i * d, a->wu + (i + q) * d};
        bf16_dot4(w, a->x, d, a->path, o);
        a->h[i] = bf16_gate(o[0], o[2], a->act);
        a->h[i + q] = bf16_gate(o[1], o[3], a->act);
    }
}

/* Gated MLP for one bf16 row: h = act(Wg·x) * (Wu·x) into ``h`` (bf16 [F]), then y = Wd·h when wd is given.
 * Wg, Wu bf16 [F, D], Wd bf16 [D, F], no biases. */
void hf_gated_mlp_bf16_res(const hf_bf16 *x, const hf_bf16 *wg, const hf_bf16 *wu, const hf_bf16 *wd, hf_bf16 *h,
                           const hf_bf16 *res, hf_bf16 *y, long f, long d, int act, int threads) {
    threads = clamp_threads(threads);
    bgated_ctx a = {x, wg, wu, h, f, d, rows_per_chunk(d * 2), act, bf16_path()};
    hf_run(bf16_gated_chunk, &a, (f / 2 + a.rows - 1) / a.rows + (f % 2 ? 1 : 0), threads);
    if (wd) gemv_bf16_res(wd, h, 0, res, y, d, f, 0, ACT_NONE, threads, 0, 0);
}

/* Gated MLP for one bf16 row: h = act(Wg·x) * (Wu·x) into ``h`` (bf16 [F]), then y = Wd·h when wd is given.
 * Wg, Wu bf16 [F, D], Wd bf16 [D, F], no biases. (hf_gated_mlp_bf16_res: plus the residual add after it.) */
void hf_gated_mlp_bf16(const hf_bf16 *x, const hf_bf16 *wg, const hf_bf16 *wu, const hf_bf16 *wd, hf_bf16 *h,
                       hf_bf16 *y, long f, long d, int act, int threads) {
    hf_gated_mlp_bf16_res(x, wg, wu, wd, h, 0, y, f, d, act, threads);
}

/* ---- bf16 row ops of a decode step (one call each instead of a chain of bf16 ATen kernels) */

/* Rotary on bf16 rows, one position: y = round(round(x*cos) + round(rotate_half(x)*sin)): every step of ATen's
 * bf16 chain rounded as it rounds (bit-equal to it). */
void hf_rotary_bf16(const hf_bf16 *x, const hf_bf16 *cos_, const hf_bf16 *sin_, hf_bf16 *y, long rows, long d,
                    int threads) {
    threads = clamp_threads(threads);
    long h = d / 2;
#pragma omp parallel for num_threads(threads) if (rows * d >= 65536) schedule(static)
    for (long r = 0; r < rows; r++) {
        const hf_bf16 *xr = x + r * d;
        hf_bf16 *yr = y + r * d;
        for (long i = 0; i < d; i++) {
            float rh = i < h ? -bf2f(xr[i + h]) : bf2f(xr[i - h]);
            yr[i] = f2bf(bf2f(f2bf(bf2f(xr[i]) * bf2f(cos_[i]))) + bf2f(f2bf(rh * bf2f(sin_[i]))));
        }
    }
}

/* Hugging Face RMSNorm of bf16 rows: h = round(x * (1 / sqrt(mean(x^2) + eps))) in fp32, y = round(w * h). */
void hf_rms_norm_bf16(const hf_bf16 *x, const hf_bf16 *w, hf_bf16 *y, long rows, long d, float eps, int threads) {
    threads = clamp_threads(threads);
#pragma omp parallel for num_threads(threads) if (rows * d >= 65536) schedule(static)
    for (long r = 0; r < rows; r++) {
        const hf_bf16 *xr = x + r * d;
        hf_bf16 *yr = y + r * d;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (long i = 0; i < d; i++) s += bf2f(xr[i]) * bf2f(xr[i]);
        float inv = 1.f / sqrtf(s / (float)d + eps);
        long i = 0;
#ifdef HF_BF16X16 /* the loop below 16 at a time (same ops, same rounding) */
        const __m512 vi = _mm512_set1_ps(inv);
        for (; i < d; i += 16) {
            __mmask16 mk = mask16(d - i);
            __m512 hv = round_bf16x16(_mm512_mul_ps(bf16x16(mk, xr + i), vi));
            store_bf16x16(yr + i, mk, w ? round_bf16x16(_mm512_mul_ps(bf16x16(mk, w + i), hv)) : hv);
        }
#endif
        for (; i < d; i++) {
            hf_bf16 hv = f2bf(bf2f(xr[i]) * inv);
            yr[i] = w ? f2bf(bf2f(w[i]) * bf2f(hv)) : hv;
        }
    }
}

/* LayerNorm of bf16 rows in fp32 (biased variance, two passes), rounded once: ATen's bf16 layer_norm does the
 * same (fp32 statistics and affine, one rounding), summing in its own order. */
void hf_layer_norm_bf16(const hf_bf16 *x, const hf_bf16 *w, const hf_bf16 *b, hf_bf16 *y, long rows, long d,
                        float eps, int threads) {
    threads = clamp_threads(threads);
#pragma omp parallel for num_threads(threads) if (rows * d >= 65536) schedule(static)
    for (long r = 0; r < rows; r++) {
        const hf_bf16 *xr = x + r * d;
        hf_bf16 *yr = y + r * d;
        float s = 0.f, q = 0.f;
#pragma omp simd reduction(+ : s)
        for (long i = 0; i < d; i++) s += bf2f(xr[i]);
        float mean = s / (float)d;
#pragma omp simd reduction(+ : q)
        for (long i = 0; i < d; i++) q += (bf2f(xr[i]) - mean) * (bf2f(xr[i]) - mean);
        float rstd = 1.f / sqrtf(q / (float)d + eps);
        long i = 0;
#ifdef HF_BF16X16 /* the loop below 16 at a time (same ops, same rounding) */
        const __m512 vm = _mm512_set1_ps(mean), vr = _mm512_set1_ps(rstd);
        for (; i < d; i += 16) {
            __mmask16 mk = mask16(d - i);
            __m512 v = _mm512_mul_ps(_mm512_sub_ps(bf16x16(mk, xr + i), vm), vr);
            if (w) v = _mm512_mul_ps(v, bf16x16(mk, w + i));
            if (b) v = _mm512_add_ps(v, bf16x16(mk, b + i));
            store_bf16x16(yr + i, mk, round_bf16x16(v));
        }
#endif
        for (; i < d; i++) {
            float v = (bf2f(xr[i]) - mean) * rstd;
            if (w) v = v * bf2f(w[i]);
            if (b) v = v + bf2f(b[i]);
            yr[i] = f2bf(v);
        }
    }
}

typedef struct {
    const hf_bf16 *q, *k_new, *v_new, *k_cache, *v_cache, *mask, *new_mask;
    hf_bf16 *out;
    float *scratch, scale;
    long h, hkv, s, d;
} batt_ctx;

/* q (fp32) . k (bf16) over d, and o += w * v (bf16) over d: AVX-512 16 at a time when d is a multiple of 16. */
static inline float bf16_qk(const float *q, const hf_bf16 *k, long d) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (d % 16 == 0) {
        __m512 a = _mm512_setzero_ps();
        for (long c = 0; c < d; c += 16)
            a = _mm512_fmadd_ps(_mm512_loadu_ps(q + c),
                                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(k + c))), 16)), a);
        return _mm512_reduce_add_ps(a);
    }
#endif
    float dt = 0.f;
#pragma omp simd reduction(+ : dt)
    for (long c = 0; c < d; c++) dt += q[c] * bf2f(k[c]);
    return dt;
}

static inline void bf16_axpy(float *o, float w, const hf_bf16 *v, long d) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (d % 16 == 0) {
        const __m512 wv = _mm512_set1_ps(w);
        for (long c = 0; c < d; c += 16)
            _mm512_storeu_ps(o + c, _mm512_fmadd_ps(wv, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + c))), 16)), _mm512_loadu_ps(o + c)));
        return;
    }
#endif
#pragma omp simd
    for (long c = 0; c < d; c++) o[c] += w * bf2f(v[c]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* bf16_qk of four q rows against one bf16 K row (d a multiple of 16): the row widened once, each sum bf16_qk's
 * chain of fused multiply-adds and its final reduce, so each result has bf16_qk's bits */
static inline void bf16_qk4(const float *const *q, const hf_bf16 *k, long d, float *out) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (long c = 0; c < d; c += 16) {
        __m512 kv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(k + c))), 16));
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q[0] + c), kv, a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q[1] + c), kv, a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(q[2] + c), kv, a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(q[3] + c), kv, a3);
    }
    out[0] = _mm512_reduce_add_ps(a0), out[1] = _mm512_reduce_add_ps(a1);
    out[2] = _mm512_reduce_add_ps(a2), out[3] = _mm512_reduce_add_ps(a3);
}

#endif

/* One head of the bf16 decode attention, in fp32 (scores, softmax, weighted sum), the output rounded once.
 * Scratch per head: s + 1 scores, then d floats of q and d of the output. */
static void bf16_att_head(void *p, long i) {
    const batt_ctx *a = p;
    long s = a->s, d = a->d, j = i / (a->h / a->hkv);
    const hf_bf16 *kc = a->k_cache + j * s * d, *vc = a->v_cache + j * s * d;
    float *pr = a->scratch + i * (s + 1 + 2 * d), *qi = pr + s + 1, *o = qi + d, scale = a->scale;
    const hf_bf16 *mask = a->mask, *vn = a->v_new + j * d;
    const long near = 2 * HF_ATT_NEAR, far = 2 * HF_ATT_FAR, rb = d * (long)sizeof(hf_bf16); /* fp32's bytes */
    for (long c = 0; c < d; c++) qi[c] = bf2f(a->q[i * d + c]);
    float mx = -INFINITY;
    /* a hidden position (-inf in the mask) scores -inf and weighs 0: its rows are not read (see att_head) */
    long first = 0;
    while (first < far && first < s && bf2f(mask[first]) != -INFINITY) first++;
    ATT_FETCH(kc, vc, 0, first < near ? first : near, rb, 3);
    ATT_FETCH(kc, vc, near, first, rb, 2);
    for (long t = 0; t < s; t++) {
        if (t + far < s && bf2f(mask[t + far]) != -INFINITY) ATT_FETCH(kc, vc, t + far, t + far + 1, rb, 2);
        if (t + near < s && bf2f(mask[t + near]) != -INFINITY) ATT_FETCH(kc, vc, t + near, t + near + 1, rb, 3);
        if (bf2f(mask[t]) == -INFINITY) {
            pr[t] = -INFINITY;
            continue;
        }
        float v = scale * bf16_qk(qi, kc + t * d, d) + bf2f(mask[t]);
        pr[t] = v;
        if (v > mx) mx = v;
    }
    float vs = scale * bf16_qk(qi, a->k_new + j * d, d) + (a->new_mask ? bf2f(*a->new_mask) : 0.f);
    pr[s] = vs;
    if (vs > mx) mx = vs;
    float iz = 1.f / softmax_exp(pr, s + 1, mx);
    /* o = Σ_t w_t·v_t in t order (zero weights skipped), one fused multiply-add per product, up to 128 columns at a
     * time in registers where d is a multiple of 16 (bf16_axpy's bits), bf16_axpy on o in memory else */
    long c0 = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (d % 16 == 0) {
        float *os[1] = {o}, *prs[1] = {pr};
        for (; c0 + 128 <= d; c0 += 128) pv_quad(os, prs, &iz, vc, vn, s, d, c0, 8, 1, 1);
        for (; c0 + 64 <= d; c0 += 64) pv_quad(os, prs, &iz, vc, vn, s, d, c0, 4, 1, 1);
        for (; c0 < d; c0 += 16) pv_quad(os, prs, &iz, vc, vn, s, d, c0, 1, 1, 1);
    }
#endif
    if (c0 < d) {
        for (long c = 0; c < d; c++) o[c] = 0.f;
        for (long t = 0; t <= s; t++) {
            float wt = pr[t] * iz;
            if (wt == 0.f) continue;
            bf16_axpy(o, wt, t < s ? vc + t * d : vn, d);
        }
    }
    for (long c = 0; c < d; c++) a->out[i * d + c] = f2bf(o[c]);
}


/* att_quad for bf16_att_head: up to four query heads of one K/V head as one task, with bf16_att_head's bits. */
static void bf16_att_quad(void *p, long c) {
    const batt_ctx *a = p;
    long s = a->s, d = a->d, j, i0;
    int nu = att_quad_task(a->h, a->hkv, c, &j, &i0);
    const hf_bf16 *kc = a->k_cache + j * s * d, *vc = a->v_cache + j * s * d, *mask = a->mask, *vn = a->v_new + j * d;
    float *pr[4], *q[4], *o[4], mx[4], iz[4], o4[4], scale = a->scale;
    for (int u = 0; u < 4; u++) {
        int uu = u < nu ? u : nu - 1; /* a missing head repeats the last one: its scores are computed, not kept */
        pr[u] = a->scratch + (i0 + uu) * (s + 1 + 2 * d), q[u] = pr[u] + s + 1, o[u] = q[u] + d;
        mx[u] = -INFINITY;
    }
    for (int u = 0; u < nu; u++)
        for (long cc = 0; cc < d; cc++) q[u][cc] = bf2f(a->q[(i0 + u) * d + cc]);
    const long near = 2 * HF_ATT_NEAR, far = 2 * HF_ATT_FAR, rb = d * (long)sizeof(hf_bf16);
    long first = 0;
    while (first < far && first < s && bf2f(mask[first]) != -INFINITY) first++;
    ATT_FETCH(kc, vc, 0, first < near ? first : near, rb, 3);
    ATT_FETCH(kc, vc, near, first, rb, 2);
    for (long t = 0; t <= s; t++) {
        const hf_bf16 *kr = t < s ? kc + t * d : a->k_new + j * d;
        float add = t < s ? bf2f(mask[t]) : a->new_mask ? bf2f(*a->new_mask) : 0.f;
        if (t < s) {
            if (t + far < s && bf2f(mask[t + far]) != -INFINITY) ATT_FETCH(kc, vc, t + far, t + far + 1, rb, 2);
            if (t + near < s && bf2f(mask[t + near]) != -INFINITY) ATT_FETCH(kc, vc, t + near, t + near + 1, rb, 3);
            if (add == -INFINITY) {
                for (int u = 0; u < nu; u++) pr[u][t] = -INFINITY;
                continue;
            }
        }
#if defined(__AVX512F__) && defined(__AVX512BW__)
        if (d % 16 == 0)
            bf16_qk4((const float *const *)q, kr, d, o4);
        else
#endif
            for (int u = 0; u < nu; u++) o4[u] = bf16_qk(q[u], kr, d);
        for (int u = 0; u < nu; u++) {
            float v = scale * o4[u] + add;
            pr[u][t] = v;
            if (v > mx[u]) mx[u] = v;
        }
    }
    for (int u = 0; u < nu; u++) iz[u] = 1.f / softmax_exp(pr[u], s + 1, mx[u]);
    long c0 = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (d % 16 == 0)
        PV_QUAD_SWITCH(nu, vn, 1)
#endif
    for (int u = 0; u < nu; u++) {
        if (c0 < d) { /* bf16_att_head's generic loop */
            for (long cc = 0; cc < d; cc++) o[u][cc] = 0.f;
            for (long t = 0; t <= s; t++) {
                float wt = pr[u][t] * iz[u];
                if (wt == 0.f) continue;
                bf16_axpy(o[u], wt, t < s ? vc + t * d : vn, d);
            }
        }
        for (long cc = 0; cc < d; cc++) a->out[(i0 + u) * d + cc] = f2bf(o[u][cc]);
    }
}

/* hf_decode_attention on bf16 tensors (mask and new_mask bf16 too); scratch fp32 [h, s + 1 + 2 d]. Tasks as in
 * hf_decode_attention (bf16_att_quad where query heads share a K/V head, the same bits). */
void hf_decode_attention_bf16(const hf_bf16 *q, const hf_bf16 *k_new, const hf_bf16 *v_new, const hf_bf16 *k_cache,
                              const hf_bf16 *v_cache, const hf_bf16 *mask, const hf_bf16 *new_mask, hf_bf16 *out,
                              float *scratch, long h, long hkv, long s, long d, float scale, int threads) {
    batt_ctx a = {q, k_new, v_new, k_cache, v_cache, mask, new_mask, out, scratch, scale, h, hkv, s, d};
    threads = clamp_threads(threads);
    long quads = att_quad_tasks(h, hkv, threads);
    hf_run(quads ? bf16_att_quad : bf16_att_head, &a, quads ? quads : h, threads);
}

/* hf_rotary_pos on bf16 (prefill: x [b, h, s, d] read with strides sb, sh, ss, cos/sin one row per position, row
 * stride cs, or one row for all when cs = 0; y dense), rounded as hf_rotary_bf16 (bit-equal to ATen's chain). */
void hf_rotary_pos_bf16(const hf_bf16 *x, const hf_bf16 *cos_, const hf_bf16 *sin_, hf_bf16 *y, long b, long nh,
                        long s, long d, long sb, long sh, long ss, long cs, int threads) {
    threads = clamp_threads(threads);
    long h = d / 2, rows = b * nh * s;
    /* per (batch, head), rows by pointer steps: no integer division per row (see hf_rotary_pos) */
#pragma omp parallel for num_threads(threads) if (rows * d >= 65536) schedule(static) collapse(2)
    for (long ib = 0; ib < b; ib++)
        for (long ih = 0; ih < nh; ih++) {
            const hf_bf16 *xr = x + ib * sb + ih * sh, *c = cos_, *sn = sin_;
            hf_bf16 *restrict yr = y + (ib * nh + ih) * s * d;
            for (long is = 0; is < s; is++, xr += ss, c += cs, sn += cs, yr += d) {
                for (long i = 0; i < h; i++)
                    yr[i] = f2bf(bf2f(f2bf(bf2f(xr[i]) * bf2f(c[i]))) + bf2f(f2bf(-bf2f(xr[i + h]) * bf2f(sn[i]))));
                for (long i = h; i < d; i++)
                    yr[i] = f2bf(bf2f(f2bf(bf2f(xr[i]) * bf2f(c[i]))) + bf2f(f2bf(bf2f(xr[i - h]) * bf2f(sn[i]))));
            }
        }
}

/* ---- prefill attention ---- */
/* softmax(scale·q·kᵀ + mask)·v over many query rows (a prefill's attention), flash-attention style.
 *
 * Why: ATen's SDPA on the strided q/k/v views of a fused qkv output ran far below the GEMMs around it on the
 * visible (causal) half of the work (docs/arch/runtime.md has the figures); a blocked ATen-matmul version was
 * slower still (one dispatch per block). Here each task is
 * one (batch, head, block of PA_QB query rows): the key blocks of PA_KB keys are visited in order with an online
 * softmax in fp32 (running max, running sum, the output rows rescaled when the max grows), so the score matrix
 * is never written out. Key blocks that the mask hides entirely are skipped: past the diagonal for is_causal
 * (top-left aligned, as SDPA's: key j is seen by query i iff j <= i), and for a mask, a block of a bool mask
 * with no True or of a float mask with only -inf (decided per block from the mask itself, so any mask is exact).
 * A row that sees no key at all gives zeros, as SDPA's CPU kernel does. q/k/v are read with their strides
 * (batch, head, row; the last dim dense), so the transposed views of a fused projection need no copy by the
 * caller: a first pass packs each kv head's keys, transposed, into one dense [d][PA_KB] tile per key block, and
 * its values into dense rows (once per call, shared by all the query heads and blocks that read them; rows of a
 * fused projection lie a large power-of-two-ish stride apart and would crowd a few L1 sets). The output is dense
 * [b, h, l, dv]. Grouped-query heads: query head i reads kv head i / (h / hkv). The products
 * use AVX-512 FMAs (4 rows x 64 columns of accumulators) where the build has AVX-512F, AVX2 FMAs (6 or 4 rows x
 * 16 columns) where it has AVX2 and FMA only, else plain C loops; the exponentials use a polynomial (Cephes' expf, ~1
 * ulp) on either vector path and expf() otherwise. Where the threads divide
 * the kv heads evenly, a thread transposes a kv head and runs its query heads' tasks itself (pa_unit); else the
 * transposition is one region and the tasks, the largest causal blocks first, are the pool's chunks. */
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* query rows per task: a causal block on the diagonal computes its scores up to its last row's key, so a block of
 * QB rows computes ~QB^2/2 pairs no row sees (a quarter of a 128-row head at 32 rows); 16 measured faster than 32
 * and no slower than 8 (bench/kernel_ab.py; the figures are in docs/arch/runtime.md) */
#define PA_QB 16
#define PA_KB 64
#define PA_DMAX 256
#define PA_KEEP ((size_t)16 << 20) /* bytes of key/value scratch a thread keeps between calls */

typedef struct {
    const float *q, *k, *v;
    const void *mask;
    float *out, *kt; /* kt: every kv head's keys transposed per key block, [b * hkv][sp / PA_KB][d][PA_KB] */
    float *vp;       /* vp: every kv head's values, dense [b * hkv][s][dv] */
    long h, hkv, l, s, d, dv, nqb, sp;
    long qs[3], ks[3], vs[3], ms[4]; /* element strides: batch, head, row (last dim dense); mask: b, h, row, col */
    long os[3];                      /* the output's element strides: batch, head, row (its last dim dense) */
    int mask_kind, causal;           /* mask_kind: 0 none, 1 bool (True = attend), 2 float (added) */
    float scale;
    int bf16; /* q/k/v/out are bf16 (read into the fp32 scratch, the fp32 result rounded once to bf16) */
} pa_ctx;

/* Element i of a q/k/v row of the call's dtype, as fp32. */
static inline float pa_in(const pa_ctx *a, const float *row, long i) {
    return a->bf16 ? bf2f(((const hf_bf16 *)row)[i]) : row[i];
}


#if defined(__AVX512F__)
/* c[r][0..64) += a[r * astride] · row[0..64) for r < 4: the 4 × 64 FMA block of both products below (scores: a is
 * q rows, row a key column block; values: a is probability rows, row a value row). */
static inline void pa_fma4x64(__m512 c[4][4], const float *a, long astride, const float *row) {
    __m512 r0 = _mm512_loadu_ps(row), r1 = _mm512_loadu_ps(row + 16), r2 = _mm512_loadu_ps(row + 32),
           r3 = _mm512_loadu_ps(row + 48);
    /* keep the four row vectors in registers: without this GCC folds each load into every FMA that reads it (four
     * loads of each vector instead of one: 20 loads per 16 FMAs), and the products run load-bound at about half
     * speed (same bits either way) */
    __asm__("" : "+v"(r0), "+v"(r1), "+v"(r2), "+v"(r3));
    for (int r = 0; r < 4; r++) {
        __m512 av = _mm512_set1_ps(a[r * astride]);
        c[r][0] = _mm512_fmadd_ps(av, r0, c[r][0]);
        c[r][1] = _mm512_fmadd_ps(av, r1, c[r][1]);
        c[r][2] = _mm512_fmadd_ps(av, r2, c[r][2]);
        c[r][3] = _mm512_fmadd_ps(av, r3, c[r][3]);
    }
}
#endif

#if defined(__AVX512F__)
/* pa_fma4x64 for the first 16·g columns only (g = 1..4, a constant where it is inlined). */
static inline __attribute__((always_inline)) void pa_fma4xg(__m512 c[4][4], const float *a, long astride,
                                                            const float *row, const int g) {
    __m512 r0 = _mm512_loadu_ps(row), r1 = g > 1 ? _mm512_loadu_ps(row + 16) : r0,
           r2 = g > 2 ? _mm512_loadu_ps(row + 32) : r0, r3 = g > 3 ? _mm512_loadu_ps(row + 48) : r0;
    __asm__("" : "+v"(r0), "+v"(r1), "+v"(r2), "+v"(r3)); /* as in pa_fma4x64 */
    for (int r = 0; r < 4; r++) {
        __m512 av = _mm512_set1_ps(a[r * astride]);
        c[r][0] = _mm512_fmadd_ps(av, r0, c[r][0]);
        if (g > 1) c[r][1] = _mm512_fmadd_ps(av, r1, c[r][1]);
        if (g > 2) c[r][2] = _mm512_fmadd_ps(av, r2, c[r][2]);
        if (g > 3) c[r][3] = _mm512_fmadd_ps(av, r3, c[r][3]);
    }
}

static inline __attribute__((always_inline)) void pa_scores_g(const float *restrict qb, const float *restrict kt,
                                                              long kst, float *restrict s, long ni, long d,
                                                              const int g) {
    for (long ii = 0; ii + 4 <= ni; ii += 4) {
        __m512 c[4][4];
        for (int r = 0; r < 4; r++)
            for (int x = 0; x < 4; x++) c[r][x] = _mm512_setzero_ps();
        for (long t = 0; t < d; t++) pa_fma4xg(c, qb + ii * d + t, d, kt + t * kst, g);
        for (int r = 0; r < 4; r++)
            for (int x = 0; x < g; x++) _mm512_storeu_ps(s + (ii + r) * PA_KB + 16 * x, c[r][x]);
    }
}
#endif

#if defined(HF_ACT8)
/* pa_scores' rows [0, R) with AVX2: R rows x 16 keys of accumulators per 16-key group (R = 6: twelve, more than
 * the eight that keep both FMA units busy through their latency, and with the two key vectors and a broadcast
 * fifteen of the sixteen registers). */
static inline __attribute__((always_inline)) void pa_scores8(const float *restrict qb, const float *restrict kt,
                                                             long kst, float *restrict s, long d, long ng,
                                                             const int R) {
    for (long g = 0; g < ng; g++) {
        __m256 c[6][2];
        for (int r = 0; r < R; r++) c[r][0] = c[r][1] = _mm256_setzero_ps();
        const float *kc = kt + 16 * g;
        for (long t = 0; t < d; t++) {
            __m256 k0 = _mm256_loadu_ps(kc + t * kst), k1 = _mm256_loadu_ps(kc + t * kst + 8);
            __asm__("" : "+x"(k0), "+x"(k1)); /* in registers, as pa_fma4x64's (else a load per FMA) */
            for (int r = 0; r < R; r++) {
                __m256 qv = _mm256_broadcast_ss(qb + r * d + t);
                c[r][0] = _mm256_fmadd_ps(qv, k0, c[r][0]);
                c[r][1] = _mm256_fmadd_ps(qv, k1, c[r][1]);
            }
        }
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(s + r * PA_KB + 16 * g, c[r][0]);
            _mm256_storeu_ps(s + r * PA_KB + 16 * g + 8, c[r][1]);
        }
    }
}
#endif

/* s[ii][0..16·ng) = qb[ii] · kt[:, 0..16·ng) for ni rows (kt: the key block transposed, rows kst apart; ng 1..4
 * groups of 16 keys: a block on the causal diagonal needs only the keys its last row sees). */
static void pa_scores(const float *restrict qb, const float *restrict kt, long kst, float *restrict s, long ni,
                      long d, long ng) {
    long ii = 0;
#if defined(__AVX512F__)
    switch (ng) {
    case 1: pa_scores_g(qb, kt, kst, s, ni, d, 1); break;
    case 2: pa_scores_g(qb, kt, kst, s, ni, d, 2); break;
    case 3: pa_scores_g(qb, kt, kst, s, ni, d, 3); break;
    default: pa_scores_g(qb, kt, kst, s, ni, d, 4); break;
    }
    ii = ni / 4 * 4;
#elif defined(HF_ACT8)
    for (; ii + 6 <= ni; ii += 6) pa_scores8(qb + ii * d, kt, kst, s + ii * PA_KB, d, ng, 6);
    for (; ii + 4 <= ni; ii += 4) pa_scores8(qb + ii * d, kt, kst, s + ii * PA_KB, d, ng, 4);
#endif
    for (; ii < ni; ii++) {
        float *sr = s + ii * PA_KB;
        for (long j = 0; j < 16 * ng; j++) sr[j] = 0.f;
        for (long t = 0; t < d; t++) {
            float qv = qb[ii * d + t];
            const float *kr = kt + t * kst;
#pragma omp simd
            for (long j = 0; j < 16 * ng; j++) sr[j] += qv * kr[j];
        }
    }
}

#if defined(HF_ACT8)
/* pa_pv's rows [0, R) with AVX2 (dv % 16 == 0): R rows x 16 value columns of accumulators, as pa_scores8's. */
static inline __attribute__((always_inline)) void pa_pv8(const float *restrict p, const float *restrict V,
                                                         long vstride, float *restrict acc, long nj, long dv,
                                                         const float *restrict cr, const int R) {
    for (long c0 = 0; c0 < dv; c0 += 16) {
        __m256 c[6][2];
        for (int r = 0; r < R; r++) {
            __m256 f = _mm256_set1_ps(cr[r]);
            c[r][0] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * dv + c0), f);
            c[r][1] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * dv + c0 + 8), f);
        }
        for (long j = 0; j < nj; j++) {
            const float *vr = V + j * vstride + c0;
            __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
            __asm__("" : "+x"(v0), "+x"(v1)); /* as in pa_scores8 */
            for (int r = 0; r < R; r++) {
                __m256 pv = _mm256_broadcast_ss(p + r * PA_KB + j);
                c[r][0] = _mm256_fmadd_ps(pv, v0, c[r][0]);
                c[r][1] = _mm256_fmadd_ps(pv, v1, c[r][1]);
            }
        }
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(acc + r * dv + c0, c[r][0]);
            _mm256_storeu_ps(acc + r * dv + c0 + 8, c[r][1]);
        }
    }
}
#endif

/* acc[ii][0..dv) = acc[ii][0..dv) · cr[ii] + p[ii][0..nj) · V[0..nj) for ni rows (V rows vstride apart, dense last
 * dim; cr: the online softmax's rescale of each row, applied as the row is loaded, not in a pass of its own). */
static void pa_pv(const float *restrict p, const float *restrict V, long vstride, float *restrict acc, long ni,
                  long nj, long dv, const float *restrict cr) {
    long ii = 0;
#if defined(__AVX512F__)
    if (dv % 64 == 0) {
        for (; ii + 4 <= ni; ii += 4)
            for (long c0 = 0; c0 < dv; c0 += 64) {
                __m512 c[4][4];
                for (int r = 0; r < 4; r++) {
                    __m512 f = _mm512_set1_ps(cr[ii + r]);
                    for (int x = 0; x < 4; x++)
                        c[r][x] = _mm512_mul_ps(_mm512_loadu_ps(acc + (ii + r) * dv + c0 + 16 * x), f);
                }
                for (long j = 0; j < nj; j++) pa_fma4x64(c, p + ii * PA_KB + j, PA_KB, V + j * vstride + c0);
                for (int r = 0; r < 4; r++)
                    for (int x = 0; x < 4; x++) _mm512_storeu_ps(acc + (ii + r) * dv + c0 + 16 * x, c[r][x]);
            }
    }
#elif defined(HF_ACT8)
    if (dv % 16 == 0) {
        for (; ii + 6 <= ni; ii += 6) pa_pv8(p + ii * PA_KB, V, vstride, acc + ii * dv, nj, dv, cr + ii, 6);
        for (; ii + 4 <= ni; ii += 4) pa_pv8(p + ii * PA_KB, V, vstride, acc + ii * dv, nj, dv, cr + ii, 4);
    }
#endif
    for (; ii < ni; ii++) {
        float *ar = acc + ii * dv;
        if (cr[ii] != 1.f)
            for (long c = 0; c < dv; c++) ar[c] *= cr[ii];
        for (long j = 0; j < nj; j++) {
            float w = p[ii * PA_KB + j];
            if (w == 0.f) continue;
            const float *vr = V + j * vstride;
#pragma omp simd
            for (long c = 0; c < dv; c++) ar[c] += w * vr[c];
        }
    }
}

/* The mask of row mrow applied to the scores t[0..cnt) of keys j..j+cnt-1: a bool mask hides (-inf) what it does not
 * show, a float mask is added. */
static inline void pa_mask_entries(const pa_ctx *a, const char *mrow, long j, float *t, long cnt) {
    for (long e = 0; e < cnt; e++) {
        long off = (j + e) * a->ms[3];
        if (a->mask_kind == 1) {
            if (!((const uint8_t *)mrow)[off]) t[e] = -INFINITY;
        } else {
            t[e] += ((const float *)mrow)[off];
        }
    }
}

/* Whether mask block [i0, i0+ni) x [j0, j0+nj) of (batch, head) base has a visible entry; *all: every one is;
 * *ext: 1 + the last column that some row of the block sees (0 when none does). Why ext: a causal mask passed as a
 * mask (GPT-2's graphs build one) hides the upper part of each diagonal block, and the products need not run past
 * the last key any row sees (as is_causal's blocks stop at the diagonal); read from the mask, so exact for any. */
static int pa_mask_block(const pa_ctx *a, const char *base, long i0, long ni, long j0, long nj, int *all, long *ext) {
    int any = 0, every = 1;
#if defined(__AVX512BW__)
    if (a->mask_kind == 1 && a->ms[3] == 1 && nj <= 64) { /* a bool mask's dense rows: 64 entries per test */
        __mmask64 live = nj == 64 ? ~(__mmask64)0 : (((__mmask64)1 << nj) - 1), seen = 0;
        for (long ii = 0; ii < ni; ii++) {
            __m512i row = _mm512_maskz_loadu_epi8(live, base + (i0 + ii) * a->ms[2] + j0);
            __mmask64 vis = _mm512_test_epi8_mask(row, row);
            seen |= vis;
            every &= vis == live;
        }
        any = seen != 0;
        *all = every;
        *ext = seen ? 64 - __builtin_clzll((unsigned long long)seen) : 0;
        return any;
    }
#endif
    long last = -1;
    for (long ii = 0; ii < ni; ii++) {
        const char *row = base + (i0 + ii) * a->ms[2] * (a->mask_kind == 1 ? 1 : 4);
        for (long jj = 0; jj < nj; jj++) {
            long off = (j0 + jj) * a->ms[3];
            int vis = a->mask_kind == 1 ? ((const uint8_t *)row)[off] != 0 : ((const float *)row)[off] != -INFINITY;
            any |= vis;
            every &= vis;
            if (vis && jj > last) last = jj;
        }
    }
    *all = every;
    *ext = last + 1;
    return any;
}

#if defined(__AVX512F__)
/* r[c] = column c of the 16 x 16 block whose rows are r[0..16) (a transpose in registers: 64 shuffles). */
static inline void pa_tr16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + k], 128-bit lane L: column 4L + k of rows 4i..4i+3 */
        __m512d a0 = _mm512_castps_pd(t[4 * i]), a1 = _mm512_castps_pd(t[4 * i + 1]);
        __m512d b0 = _mm512_castps_pd(t[4 * i + 2]), b1 = _mm512_castps_pd(t[4 * i + 3]);
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, b0));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, b0));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, b1));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, b1));
    }
    for (int k = 0; k < 4; k++) {
        __m512 lo01 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x44), hi01 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xEE);
        __m512 lo23 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x44);
        __m512 hi23 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xEE);
        r[k] = _mm512_shuffle_f32x4(lo01, lo23, 0x88);
        r[4 + k] = _mm512_shuffle_f32x4(lo01, lo23, 0xDD);
        r[8 + k] = _mm512_shuffle_f32x4(hi01, hi23, 0x88);
        r[12 + k] = _mm512_shuffle_f32x4(hi01, hi23, 0xDD);
    }
}
#endif

#if defined(HF_ACT8)
/* r[c] = column c of the 8 x 8 block whose rows are r[0..8) (a transpose in registers: 24 shuffles). */
static inline void pa_tr8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]); /* a0 b0 a1 b1 | a4 b4 a5 b5 */
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) { /* u[4i + k]: column k (low lane) and 4 + k (high lane) of rows 4i..4i+3 */
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
        r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
    }
}
#endif

/* Keys of kv head (batch, head) = t transposed into kt, one dense [d][PA_KB] tile per key block (zeros past s; a
 * tile, not rows sp apart: rows of a power-of-two stride would fall into a few L1 sets): once per call, shared by
 * every query block. */
static void pa_transpose(void *p, long t) {
    const pa_ctx *a = p;
    long esz = a->bf16 ? 2 : 4;
    const char *K = (const char *)a->k + ((t / a->hkv) * a->ks[0] + (t % a->hkv) * a->ks[1]) * esz;
    float *kt = a->kt + t * a->d * a->sp;
#if defined(__AVX512F__)
    /* 16 keys x 16 dims at a time: the keys' rows (widened from bf16, zero past s) into 16 registers, transposed
     * there (pa_tr16), each dim's 16 keys stored into its tile row (the plain loop below stores one float per step,
     * a whole tile row apart; gathering each dim's keys from a dense block in memory took twice the shuffles' time) */
    /* up to the 16-key group of the last key: the products read a block's keys in groups of 16 up to the last one
     * some row sees (pa_task's nv), never the zero groups past s */
    for (long j0 = 0; j0 < a->s; j0 += 16) {
        float *tile = kt + (j0 / PA_KB) * a->d * PA_KB + j0 % PA_KB;
        /* the next 16 keys' rows, requested now: they lie a projection row apart (a fused qkv output's stride),
         * which the hardware prefetchers do not follow, and their first loads stalled this pass (the before/after
         * is in docs/arch/runtime.md; same bits) */
        for (long r = j0 + 16; r < j0 + 32 && r < a->s; r++) {
            const char *nr = K + r * a->ks[2] * esz;
            for (long off = 0; off < a->d * esz; off += 64) _mm_prefetch(nr + off, _MM_HINT_T0);
        }
        for (long c0 = 0; c0 < a->d; c0 += 16) {
            long nc = a->d - c0 < 16 ? a->d - c0 : 16;
            __mmask16 mk = (__mmask16)(nc == 16 ? 0xFFFF : (1u << nc) - 1);
            __m512 rows[16];
            for (long r = 0; r < 16; r++) {
                long j = j0 + r;
                __m512 v = _mm512_setzero_ps();
                if (j < a->s) {
                    const char *kr = K + (j * a->ks[2] + c0) * esz;
                    v = a->bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                      _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, (const void *)kr)), 16))
                                : _mm512_maskz_loadu_ps(mk, (const float *)kr);
                }
                rows[r] = v;
            }
            pa_tr16(rows);
            for (long c = 0; c < nc; c++) _mm512_storeu_ps(tile + (c0 + c) * PA_KB, rows[c]);
        }
    }
#else
    long j1 = 0; /* the keys from j1 on take the plain loop below */
#if defined(HF_ACT8)
    /* fp32 keys 8 x 8 at a time, transposed in registers (pa_tr8) as the AVX-512 path does 16 x 16 (the plain loop
     * stores one float per step, a tile row apart), up to the 16-key group of the last key (zeros past s); the
     * groups past it are never read (pa_task's nv), so the plain loop has none left */
    if (!a->bf16) {
        long d8 = a->d / 8 * 8, s16 = (a->s + 15) / 16 * 16; /* s rounded up to a 16-key group */
        j1 = a->sp;
        for (long j0 = 0; j0 < s16; j0 += 8) {
            float *tile = kt + (j0 / PA_KB) * a->d * PA_KB + j0 % PA_KB;
            for (long c0 = 0; c0 < d8; c0 += 8) {
                __m256 rows[8];
                for (long r = 0; r < 8; r++)
                    rows[r] = j0 + r < a->s ? _mm256_loadu_ps((const float *)(K + (j0 + r) * a->ks[2] * esz) + c0)
                                            : _mm256_setzero_ps();
                pa_tr8(rows);
                for (long c = 0; c < 8; c++) _mm256_storeu_ps(tile + (c0 + c) * PA_KB, rows[c]);
            }
            for (long j = j0; j < j0 + 8; j++) /* the dims past the last 8 */
                for (long c = d8; c < a->d; c++)
                    tile[c * PA_KB + j - j0] = j < a->s ? ((const float *)(K + j * a->ks[2] * esz))[c] : 0.f;
        }
    }
#endif
    for (long j = j1; j < a->sp; j++) {
        float *tile = kt + (j / PA_KB) * a->d * PA_KB + j % PA_KB;
        const float *kr = (const float *)(K + j * a->ks[2] * esz);
        for (long c = 0; c < a->d; c++) tile[c * PA_KB] = j < a->s ? pa_in(a, kr, c) : 0.f;
    }
#endif
    const char *V = (const char *)a->v + ((t / a->hkv) * a->vs[0] + (t % a->hkv) * a->vs[1]) * esz;
    float *vp = a->vp + t * a->s * a->dv;
    for (long j = 0; j < a->s; j++) {
        const float *vr = (const float *)(V + j * a->vs[2] * esz);
        if (a->bf16)
            for (long c = 0; c < a->dv; c++) vp[j * a->dv + c] = bf2f(((const hf_bf16 *)vr)[c]);
        else
            memcpy(vp + j * a->dv, vr, sizeof(float) * a->dv);
    }
}

#if defined(__AVX512F__)
/* Bits of the 16 columns [16c, 16c + 16) that are below cnt. */
static inline __mmask16 pa_below(long cnt, int c) {
    long n = cnt - 16 * c;
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

#endif

#if defined(__AVX512F__)
/* Lane r of the result = the sum (add != 0) or max of v[r]'s 16 lanes, for 16 vectors at once: a transposing
 * reduction (four folding stages of shuffles, then one permute into row order). The sums fold in the order
 * _mm512_reduce_add_ps folds one vector (halves, quarters, then within a 128-bit lane), so a row's sum has the bits
 * that reduction gives it. Why: reduced one at a time, each row's vector is a chain of dependent shuffles, sixteen
 * chains per block of rows; folded together, the shuffles of different rows share each stage. */
_Static_assert(PA_QB == 16, "pa_fold16 folds one vector per query row of a task");
static inline __m512 pa_fold16(const __m512 v[PA_QB], int add) {
    __m512 w[8], u[4], s2[2];
#define PA_OP(x, y) (add ? _mm512_add_ps(x, y) : _mm512_max_ps(x, y))
    for (int i = 0; i < 8; i++)
        w[i] = PA_OP(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                     _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        u[i] = PA_OP(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                     _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        s2[i] = PA_OP(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    __m512 f = PA_OP(_mm512_shuffle_ps(s2[0], s2[1], 0x88), _mm512_shuffle_ps(s2[0], s2[1], 0xDD));
#undef PA_OP
    /* f's element 4L + e holds row L + 4e */
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), f);
}

/* The online-softmax step of a block of rows over one key block, all rows at once, over the block's 16-key groups
 * up to nv (the groups past it are hidden from every row: neither computed nor read, so skipped here too; a causal
 * diagonal block of PA_QB rows has 1 to 4 of its 4 groups visible; same bits as visiting all 4): each
 * row's scores past cnt (its diagonal or the block's end) and those the mask hides set to -inf (a float mask
 * added), the rows' maxima folded into one vector, the rescale factors exp(m - m_new) as one vector exponential,
 * then each row's exponentials and their sums folded likewise; m, z and cr (PA_QB floats each) updated. A row
 * that sees nothing yet gets zeros, factor 0 and keeps m = -inf and z = 0 (its sums are zero). Why not row by
 * row (as before session 46): each row paid two horizontal reductions and a scalar expf for its factor
 * (kernel_ab before/after in docs/arch/runtime.md). */
static void pa_softmax_rows(const pa_ctx *a, float *restrict sb, const char *mbase, long i0, long ni, long j0,
                            long nv, int apply, float *m, float *z, float *cr) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    long esz = a->mask_kind == 1 ? 1 : 4;
    /* only the 16-key groups up to nv: the products computed no more (pa_scores), and pa_pv reads no more */
    const int ngv = (int)((nv + 15) / 16);
    __m512 part[PA_QB];
    for (long ii = 0; ii < PA_QB; ii++) {
        part[ii] = ninf;
        if (ii >= ni) continue;
        float *sr = sb + ii * PA_KB;
        long i = i0 + ii, cnt = a->causal && i - j0 + 1 < nv ? i - j0 + 1 : nv;
        const char *mrow = mbase ? mbase + i * a->ms[2] * esz : NULL;
        __m512 vmax = ninf;
        for (int c = 0; c < ngv; c++) {
            __mmask16 keep = pa_below(cnt, c);
            __m512 x = _mm512_mask_mov_ps(ninf, keep, _mm512_loadu_ps(sr + 16 * c));
            if (apply && keep) {
                if (a->ms[3] == 1 && keep == 0xffff) {
                    if (a->mask_kind == 1) {
                        __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(mrow + j0 + 16 * c)));
                        x = _mm512_mask_mov_ps(ninf, _mm512_test_epi32_mask(b, b), x);
                    } else {
                        x = _mm512_add_ps(x, _mm512_loadu_ps((const float *)mrow + j0 + 16 * c));
                    }
                } else {
                    float t[16];
                    _mm512_storeu_ps(t, x);
                    pa_mask_entries(a, mrow, j0 + 16 * c, t, __builtin_popcount(keep)); /* keep: the low bits */
                    x = _mm512_loadu_ps(t);
                }
            }
            _mm512_storeu_ps(sr + 16 * c, x);
            vmax = _mm512_max_ps(vmax, x);
        }
        part[ii] = vmax;
    }
    __m512 mold = _mm512_loadu_ps(m), mn = _mm512_max_ps(mold, pa_fold16(part, 0));
    /* exp(m - m_new): 1 where the maximum stayed, 0 where m was -inf (-inf - x, and -inf - -inf = NaN, give 0) */
    __m512 corr = pa_exp16(_mm512_sub_ps(mold, mn));
    float mv[PA_QB] __attribute__((aligned(64)));
    _mm512_store_ps(mv, mn);
    for (long ii = 0; ii < PA_QB; ii++) {
        part[ii] = _mm512_setzero_ps();
        if (ii >= ni) continue;
        float *sr = sb + ii * PA_KB;
        __m512 vm = _mm512_set1_ps(mv[ii]), vs = _mm512_setzero_ps();
        for (int c = 0; c < ngv; c++) { /* a row with m_new = -inf: every x - m_new is NaN, every exponential 0 */
            __m512 e = pa_exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + 16 * c), vm));
            _mm512_storeu_ps(sr + 16 * c, e);
            vs = _mm512_add_ps(vs, e);
        }
        part[ii] = vs;
    }
    _mm512_storeu_ps(z, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(z), corr), pa_fold16(part, 1)));
    _mm512_storeu_ps(m, mn);
    _mm512_storeu_ps(cr, corr);
}
#endif

#if defined(HF_ACT8)
static inline float hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

static inline float hsum8(__m256 v) {
    return hsum_halves128(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}

/* pa_softmax_rows with AVX2, row by row: each row's scores past cnt (its diagonal or nv) set to -inf, a mask
 * applied (a bool mask of dense rows 8 entries at a time, else entry by entry), the row's maximum, its rescale
 * factor exp(m - m_new) (expf: one per row and key block), its exponentials (pa_exp8) and their sum; m, z and cr
 * updated. A row that sees nothing yet gets zeros and keeps m = -inf and z = 0. Over the 16-key groups up to nv,
 * as the products computed (pa_scores) and pa_pv reads. */
static void pa_softmax_rows8(const pa_ctx *a, float *restrict sb, const char *mbase, long i0, long ni, long j0,
                             long nv, int apply, float *m, float *z, float *cr) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    long esz = a->mask_kind == 1 ? 1 : 4;
    const long nw = (nv + 15) / 16 * 2; /* 8-key vectors up to nv's 16-key group */
    for (long ii = 0; ii < ni; ii++) {
        float *sr = sb + ii * PA_KB;
        long i = i0 + ii, cnt = a->causal && i - j0 + 1 < nv ? i - j0 + 1 : nv;
        const char *mrow = mbase ? mbase + i * a->ms[2] * esz : NULL;
        __m256 vmax = ninf;
        for (long c = 0; c < nw; c++) {
            __m256 x = _mm256_loadu_ps(sr + 8 * c);
            long n = cnt - 8 * c;
            if (n < 8) { /* lanes from n on: -inf */
                __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 0 ? 0 : n)), iota);
                x = _mm256_blendv_ps(ninf, x, _mm256_castsi256_ps(live));
            }
            if (apply && n > 0) {
                if (a->mask_kind == 1 && a->ms[3] == 1 && n >= 8) {
                    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mrow + j0 + 8 * c)));
                    x = _mm256_blendv_ps(x, ninf, _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, _mm256_setzero_si256())));
                } else {
                    float t[8];
                    _mm256_storeu_ps(t, x);
                    pa_mask_entries(a, mrow, j0 + 8 * c, t, n < 8 ? n : 8);
                    x = _mm256_loadu_ps(t);
                }
            }
            _mm256_storeu_ps(sr + 8 * c, x);
            vmax = _mm256_max_ps(vmax, x);
        }
        float mx = hmax8(vmax), mn = mx > m[ii] ? mx : m[ii];
        if (mn == -INFINITY) { /* nothing visible to this row yet: its output so far is zero */
            for (long c = 0; c < nw; c++) _mm256_storeu_ps(sr + 8 * c, _mm256_setzero_ps());
            cr[ii] = 1.f;
            continue;
        }
        float corr = m[ii] == -INFINITY ? 0.f : expf(m[ii] - mn);
        __m256 vm = _mm256_set1_ps(mn), vs = _mm256_setzero_ps();
        for (long c = 0; c < nw; c++) { /* -inf - m_new gives exp 0 */
            __m256 e = pa_exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + 8 * c), vm));
            _mm256_storeu_ps(sr + 8 * c, e);
            vs = _mm256_add_ps(vs, e);
        }
        z[ii] = z[ii] * corr + hsum8(vs);
        m[ii] = mn;
        cr[ii] = corr;
    }
}
#endif

static void pa_task(void *p, long t) {
    const pa_ctx *a = p;
    long bh = t / a->nqb, qblk = a->nqb - 1 - t % a->nqb; /* the largest causal blocks first */
    long bi = bh / a->h, hi = bh % a->h, kh = hi / (a->h / a->hkv), d = a->d, dv = a->dv;
    long i0 = qblk * PA_QB, ni = a->l - i0 < PA_QB ? a->l - i0 : PA_QB;
    long qsz = a->bf16 ? 2 : 4; /* bytes of a q element */
    const char *Q = (const char *)a->q + (bi * a->qs[0] + hi * a->qs[1]) * qsz;
    const float *V = a->vp + (bi * a->hkv + kh) * a->s * dv;
    const float *KT = a->kt + (bi * a->hkv + kh) * d * a->sp;
    long o0 = bi * a->os[0] + hi * a->os[1] + i0 * a->os[2]; /* the output's first element of this task */
    int esz = a->mask_kind == 1 ? 1 : 4;
    const char *mbase = a->mask ? (const char *)a->mask + (bi * a->ms[0] + hi * a->ms[1]) * esz : NULL;
    float qb[PA_QB * PA_DMAX] __attribute__((aligned(64)));
    float sb[PA_QB * PA_KB] __attribute__((aligned(64)));
    float acc[PA_QB * PA_DMAX] __attribute__((aligned(64)));
    float m[PA_QB], z[PA_QB], cr[PA_QB]; /* cr: each row's rescale for this key block (pa_pv applies it) */
    for (long ii = 0; ii < PA_QB; ii++) m[ii] = -INFINITY, z[ii] = 0.f, cr[ii] = 1.f;
    for (long ii = 0; ii < ni; ii++) {
        const float *qr = (const float *)(Q + (i0 + ii) * a->qs[2] * qsz);
        long c = 0;
#if defined(__AVX512F__) /* the loop below 16 at a time (same products) */
        const __m512 vs = _mm512_set1_ps(a->scale);
        for (; c + 16 <= d; c += 16) {
            __m512 x = a->bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const hf_bf16 *)qr + c))), 16))
                               : _mm512_loadu_ps(qr + c);
            _mm512_storeu_ps(qb + ii * d + c, _mm512_mul_ps(x, vs));
        }
#endif
        for (; c < d; c++) qb[ii * d + c] = pa_in(a, qr, c) * a->scale;
    }
    memset(acc, 0, sizeof(float) * ni * dv);
    for (long j0 = 0; j0 < a->s; j0 += PA_KB) {
        long nj = a->s - j0 < PA_KB ? a->s - j0 : PA_KB;
        int all = 1;
        long ext = nj;
        if (a->causal && j0 > i0 + ni - 1) break; /* every later key block is past the diagonal */
        if (mbase && !pa_mask_block(a, mbase, i0, ni, j0, nj, &all, &ext)) continue;
        /* the keys any row of this block sees: up to the last row's diagonal for is_causal, up to the last key the
         * mask shows a row (ext) for a mask; the columns from nv on are hidden from every row */
        long nv = a->causal && i0 + ni - j0 < nj ? i0 + ni - j0 : nj;
        nv = ext < nv ? ext : nv;
        pa_scores(qb, KT + j0 * d, PA_KB, sb, ni, d, (nv + 15) / 16); /* tile j0 / PA_KB at (j0 / PA_KB) * d * PA_KB */
#if defined(__AVX512F__)
        pa_softmax_rows(a, sb, mbase, i0, ni, j0, nv, mbase && !(a->mask_kind == 1 && all), m, z, cr);
#elif defined(HF_ACT8)
        pa_softmax_rows8(a, sb, mbase, i0, ni, j0, nv, mbase && !(a->mask_kind == 1 && all), m, z, cr);
#else
        for (long ii = 0; ii < ni; ii++) {
            float *sr = sb + ii * PA_KB;
            long i = i0 + ii;
            cr[ii] = 1.f; /* the plain path below rescales the row itself */
            for (long jj = nv; jj < PA_KB; jj++) sr[jj] = -INFINITY; /* past nv: not computed, hidden */
            if (a->causal && j0 + nj - 1 > i)
                for (long jj = i - j0 + 1 < 0 ? 0 : i - j0 + 1; jj < nj; jj++) sr[jj] = -INFINITY;
            if (mbase && !(a->mask_kind == 1 && all)) pa_mask_entries(a, mbase + i * a->ms[2] * esz, j0, sr, nj);
            float mx = -INFINITY;
            for (long jj = 0; jj < PA_KB; jj++) mx = sr[jj] > mx ? sr[jj] : mx;
            float mn = mx > m[ii] ? mx : m[ii];
            if (mn == -INFINITY) { /* nothing visible to this row yet */
                for (long jj = 0; jj < PA_KB; jj++) sr[jj] = 0.f;
                continue;
            }
            float corr = m[ii] == -INFINITY ? 0.f : expf(m[ii] - mn), sum = 0.f;
            for (long jj = 0; jj < PA_KB; jj++) {
                float e = expf(sr[jj] - mn);
                sr[jj] = e;
                sum += e;
            }
            z[ii] = z[ii] * corr + sum;
            m[ii] = mn;
            if (corr != 1.f) {
                float *ar = acc + ii * dv;
                for (long c = 0; c < dv; c++) ar[c] *= corr;
            }
        }
#endif
        pa_pv(sb, V + j0 * dv, dv, acc, ni, nv, dv, cr); /* keys past nv have probability 0 in every row */
    }
    for (long ii = 0; ii < ni; ii++) {
        float iz = z[ii] > 0.f ? 1.f / z[ii] : 0.f; /* a row that saw no key: zeros, as SDPA gives */
        if (a->bf16) {
            hf_bf16 *orow = (hf_bf16 *)a->out + o0 + ii * a->os[2];
            long c = 0;
#ifdef HF_BF16X16 /* the loop below 16 at a time (same product, same rounding) */
            for (; c + 16 <= dv; c += 16)
                store_bf16x16(orow + c, 0xFFFF,
                              round_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(acc + ii * dv + c), _mm512_set1_ps(iz))));
#endif
            for (; c < dv; c++) orow[c] = f2bf(acc[ii * dv + c] * iz);
        }
        else {
            float *orow = a->out + o0 + ii * a->os[2];
            long c = 0;
#if defined(__AVX512F__) /* the loop below 16 at a time (same products) */
            for (; c + 16 <= dv; c += 16)
                _mm512_storeu_ps(orow + c, _mm512_mul_ps(_mm512_loadu_ps(acc + ii * dv + c), _mm512_set1_ps(iz)));
#endif
            for (; c < dv; c++) orow[c] = acc[ii * dv + c] * iz;
        }
    }
}

/* A few query rows over a few keys (at most PA_SMALL pairs per head: a one-token forward's attention, one query
 * and one key per head): the same arithmetic (q scaled first, fp32 sums, max-subtracted exponentials, rows that see
 * no key give zeros) in one pass per head on the calling thread, straight from the strided q/k/v and with expf.
 * Why: the blocked path packs a PA_KB-key tile per kv head and runs a PA_QB x PA_KB tile per head, many times the
 * work of a few dot products here. */
#define PA_SMALL 64
static void pa_small(const pa_ctx *a, long b) {
    long esz = a->bf16 ? 2 : 4, mesz = a->mask_kind == 1 ? 1 : 4;
    float sc[PA_SMALL], acc[PA_DMAX];
    for (long bi = 0; bi < b; bi++)
        for (long hi = 0; hi < a->h; hi++) {
            long kh = hi / (a->h / a->hkv);
            const char *Q = (const char *)a->q + (bi * a->qs[0] + hi * a->qs[1]) * esz;
            const char *K = (const char *)a->k + (bi * a->ks[0] + kh * a->ks[1]) * esz;
            const char *V = (const char *)a->v + (bi * a->vs[0] + kh * a->vs[1]) * esz;
            const char *M = a->mask ? (const char *)a->mask + (bi * a->ms[0] + hi * a->ms[1]) * mesz : NULL;
            for (long i = 0; i < a->l; i++) {
                const float *qr = (const float *)(Q + i * a->qs[2] * esz);
                float mx = -INFINITY;
                for (long j = 0; j < a->s; j++) {
                    const char *mp = M ? M + (i * a->ms[2] + j * a->ms[3]) * mesz : NULL;
                    float v = -INFINITY;
                    if (!(a->causal && j > i) && !(mp && a->mask_kind == 1 && !*(const uint8_t *)mp)) {
                        const float *kr = (const float *)(K + j * a->ks[2] * esz);
                        float dot = 0.f;
                        for (long c = 0; c < a->d; c++) dot += (pa_in(a, qr, c) * a->scale) * pa_in(a, kr, c);
                        v = mp && a->mask_kind == 2 ? dot + *(const float *)mp : dot;
                    }
                    sc[j] = v;
                    mx = v > mx ? v : mx;
                }
                float z = 0.f;
                for (long c = 0; c < a->dv; c++) acc[c] = 0.f;
                if (mx != -INFINITY)
                    for (long j = 0; j < a->s; j++) {
                        if (sc[j] == -INFINITY) continue;
                        float e = expf(sc[j] - mx);
                        const float *vr = (const float *)(V + j * a->vs[2] * esz);
                        z += e;
                        for (long c = 0; c < a->dv; c++) acc[c] += e * pa_in(a, vr, c);
                    }
                float iz = z > 0.f ? 1.f / z : 0.f;
                long o0 = bi * a->os[0] + hi * a->os[1] + i * a->os[2];
                if (a->bf16)
                    for (long c = 0; c < a->dv; c++) ((hf_bf16 *)a->out)[o0 + c] = f2bf(acc[c] * iz);
                else
                    for (long c = 0; c < a->dv; c++) a->out[o0 + c] = acc[c] * iz;
            }
        }
}

/* ---- bf16 prefill attention on AMX tiles ----
 * The bf16 case of hf_prefill_attention without a mask (causal or not), head dims d % 32 == 0 and dv % 16 == 0:
 * q·kᵀ and p·v as tdpbf16ps products instead of widened fp32 FMAs.
 * Why: the FMA kernel widens every bf16 operand and multiplies in fp32 at 16 products per instruction; a tile
 * product does 16 x 16 x 32 per instruction, so at a prompt's sizes the attention is dominated by the packing and
 * the softmax instead of the products (docs/arch/runtime.md has the figures).
 * How: a first pass packs each kv head's keys into B tiles in the VNNI layout tdpbf16ps reads (per 16 keys and 32 dims:
 * 16 rows of 16 (key, dim pair) dwords, transposed in registers from the strided rows; zero past s) and its values
 * likewise (per 32 keys and 16 value columns: 16 rows of 16 (key pair, column) dwords: two value rows interleaved; zero
 * past s). A task is (batch, head, 16 query rows): its q rows are copied into a zero-padded tile; the scores of every
 * visible key (up to the diagonal for is_causal) go to fp32 scratch, scaled; each row's softmax is computed exactly
 * (the row's max, exponentials, their fp32 sum); the exponentials are rounded to bf16 (the p operand, as SDPA's bf16
 * CPU kernel rounds its p before its p·v product) and multiplied with the values into fp32 accumulator tiles, four
 * value column blocks at a time; the output is that sum over the fp32 sum of exponentials, rounded once to bf16.
 * Scratch: the packed keys/values per call, the scores and p per thread (kept between calls). Returns -3 where AMX is
 * not usable (the caller runs the FMA path). */
#ifndef PAM_ONE_THREAD
#define PAM_ONE_THREAD (1L << 22) /* products (b·h·l·s·(d + dv)) below which the AMX attention runs on one thread */
#endif
/* The same arithmetic on AVX512-BF16 where the CPU has no AMX (e.g. AMD Zen 4): vdpbf16ps does 16 lanes x 2 bf16
 * products per instruction, twice the widened fp32 FMAs' rate, on the packing above read as vectors (pad_task). */
#if defined(__AVX512BF16__) && defined(HF_BF16X16)
#define HF_PA_DPBF16 1
#endif
#if defined(HF_AMX) || defined(HF_PA_DPBF16)
typedef struct {
    const hf_bf16 *q, *k, *v;
    hf_bf16 *out;
    uint32_t *kp, *vp; /* packed keys [b * hkv][sg][d / 32][16][16], values [b * hkv][s32 / 32][dv / 16][16][16] */
    char *ts;          /* per-thread task scratch (omp_get_thread_num() * tsz): q tile rows, scores, p */
    size_t tsz;
    long h, hkv, l, s, d, dv, nqb, sg, s32;
    long qs[3], ks[3], vs[3], os[3];
    int causal;
    float scale;
    void (*task)(void *, long); /* pam_task (AMX tiles) or pad_task (AVX512-BF16), for pam_unit */
} pam_ctx;

static void pam_pack(void *p, long t) {
    const pam_ctx *a = p;
    long bi = t / a->hkv, kh = t % a->hkv, kd = a->d / 32, vd = a->dv / 16;
    const hf_bf16 *K = a->k + bi * a->ks[0] + kh * a->ks[1], *V = a->v + bi * a->vs[0] + kh * a->vs[1];
    uint32_t *kp = a->kp + (size_t)t * a->sg * kd * 256, *vp = a->vp + (size_t)t * (a->s32 / 32) * vd * 256;
    /* keys: tile (g, c) row r = the dword (dims 32c + 2r, 32c + 2r + 1) of keys 16g .. 16g + 15: the 16 keys' 64
     * bytes of dims 32c.. as 16 dwords each, a 16 x 16 dword transpose in registers (pa_tr16 moves the bits as
     * floats; zeros for keys past s). Gathering each row's 16 dwords from the strided keys took longer. */
    for (long g = 0; g < a->sg; g++) {
        long live = a->s - 16 * g < 16 ? a->s - 16 * g : 16;
        for (long c = 0; c < kd; c++) {
            const hf_bf16 *base = K + 16 * g * a->ks[2] + 32 * c;
            uint32_t *tile = kp + (g * kd + c) * 256;
            __m512 rows[16];
            for (long r = 0; r < 16; r++)
                rows[r] = r < live ? _mm512_castsi512_ps(_mm512_loadu_si512((const void *)(base + r * a->ks[2])))
                                   : _mm512_setzero_ps();
            pa_tr16(rows);
            for (int r = 0; r < 16; r++) _mm512_storeu_si512(tile + 16 * r, _mm512_castps_si512(rows[r]));
        }
    }
    /* values: tile (j, u) row r = (v[32j + 2r][16u + c], v[32j + 2r + 1][16u + c]) for c < 16 */
    for (long j = 0; j < a->s32 / 32; j++)
        for (int r = 0; r < 16; r++) {
            long k0 = 32 * j + 2 * r, k1 = k0 + 1;
            for (long u = 0; u < vd; u++) {
                __m512i lo = k0 < a->s ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(V + k0 * a->vs[2] + 16 * u)))
                                       : _mm512_setzero_si512();
                __m512i hi = k1 < a->s ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(V + k1 * a->vs[2] + 16 * u)))
                                       : _mm512_setzero_si512();
                _mm512_storeu_si512(vp + ((j * vd + u) * 16 + r) * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
}

/* Rows [0, 16) of a task's scores sc (ls floats a row; row r sees cnt(r) keys): scaled, max-subtracted
 * exponentials rounded to bf16 into pb (n32 a row, zero past cnt), their fp32 sums into zs (0 for a row that sees
 * nothing: rows past ni). */
static void pam_softmax(const pam_ctx *a, float *sc, long ls, hf_bf16 *pb, long n32, long i0, long ni, long nk,
                        float *zs) {
    const __m512 vsc = _mm512_set1_ps(a->scale), ninf = _mm512_set1_ps(-INFINITY);
    for (long r = 0; r < 16; r++) {
        float *sr = sc + r * ls;
        hf_bf16 *pr = pb + r * n32;
        long cnt = r >= ni ? 0 : a->causal ? (i0 + r + 1 < nk ? i0 + r + 1 : nk) : nk; /* keys row r sees */
        __m512 vmax = ninf;
        for (long j = 0; j < cnt; j += 16) {
            __mmask16 mk = mask16(cnt - j);
            __m512 x = _mm512_mask_mov_ps(ninf, mk, _mm512_mul_ps(_mm512_loadu_ps(sr + j), vsc));
            _mm512_storeu_ps(sr + j, x);
            vmax = _mm512_max_ps(vmax, x);
        }
        float mx = cnt ? _mm512_reduce_max_ps(vmax) : 0.f;
        __m512 vm = _mm512_set1_ps(mx), vs = _mm512_setzero_ps();
        for (long j = 0; j < n32; j += 16) {
            __m512 e = _mm512_setzero_ps();
            if (j < cnt) {
                __mmask16 mk = mask16(cnt - j);
                e = _mm512_maskz_mov_ps(mk, pa_exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + j), vm)));
                vs = _mm512_add_ps(vs, e);
            }
            store_bf16x16(pr + j, 0xFFFF, round_bf16x16(e));
        }
        zs[r] = cnt ? _mm512_reduce_add_ps(vs) : 0.f;
    }
}

/* A task's q rows [i0, i0 + ni) into the zero-padded 16-row bf16 tile qt. */
static void pam_qtile(const pam_ctx *a, hf_bf16 *qt, long bi, long hi, long i0, long ni) {
    const hf_bf16 *Q = a->q + bi * a->qs[0] + hi * a->qs[1];
    for (long r = 0; r < 16; r++) {
        if (r < ni) memcpy(qt + r * a->d, Q + (i0 + r) * a->qs[2], sizeof(hf_bf16) * a->d);
        else memset(qt + r * a->d, 0, sizeof(hf_bf16) * a->d);
    }
}

/* One task of the bf16-product attention (see pam_task): (batch, head, 16 query rows), the keys its rows see, where
 * its kv head's packing lies, and this thread's scratch: q tile rows [16][d] bf16, scores [16][ng * 16] fp32 (ls
 * floats a row), p [16][n32] bf16. */
typedef struct {
    long bi, hi, i0, ni, nk, ng, n32, ls;
    const uint32_t *kp, *vp;
    hf_bf16 *qt, *pb;
    float *sc;
} pam_at;

/* Task t's pam_at, its q tile filled (pam_qtile). */
static pam_at pam_begin(const pam_ctx *a, long t) {
    pam_at k;
    long bh = t / a->nqb, qblk = a->nqb - 1 - t % a->nqb; /* the largest causal blocks first */
    long kh = (bh % a->h) / (a->h / a->hkv), kd = a->d / 32, vd = a->dv / 16;
    k.bi = bh / a->h, k.hi = bh % a->h, k.i0 = qblk * 16, k.ni = a->l - k.i0 < 16 ? a->l - k.i0 : 16;
    k.nk = a->causal ? (k.i0 + k.ni < a->s ? k.i0 + k.ni : a->s) : a->s; /* keys any row of the block sees */
    k.ng = (k.nk + 15) / 16, k.n32 = (k.nk + 31) / 32 * 32, k.ls = k.ng * 16;
    k.kp = a->kp + (size_t)(k.bi * a->hkv + kh) * a->sg * kd * 256;
    k.vp = a->vp + (size_t)(k.bi * a->hkv + kh) * (a->s32 / 32) * vd * 256;
    k.qt = (hf_bf16 *)(a->ts + (size_t)omp_get_thread_num() * a->tsz);
    k.sc = (float *)(k.qt + 16 * a->d);
    k.pb = (hf_bf16 *)(k.sc + 16 * k.ls);
    pam_qtile(a, k.qt, k.bi, k.hi, k.i0, k.ni);
    return k;
}

/* Output rows [0, ni) of a task, columns [16·u0, 16·(u0 + nu)): the sums ob (64 floats a row) over zs, rounded. */
static void pam_store(const pam_ctx *a, const float *ob, const float *zs, hf_bf16 *O, long ni, long u0, long nu) {
    for (long r = 0; r < ni; r++) {
        __m512 iz = _mm512_set1_ps(zs[r] > 0.f ? 1.f / zs[r] : 0.f);
        for (long u = 0; u < nu; u++)
            store_bf16x16(O + r * a->os[2] + 16 * (u0 + u), 0xFFFF,
                          round_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(ob + r * 64 + 16 * u), iz)));
    }
}
#endif

#ifdef HF_AMX
static void pam_task(void *p, long t) {
    const pam_ctx *a = p;
    const pam_at k = pam_begin(a, t);
    long d = a->d, kd = d / 32, vd = a->dv / 16, ng = k.ng, n32 = k.n32, ls = k.ls;
    const uint32_t *kp = k.kp, *vp = k.vp;
    hf_bf16 *qt = k.qt, *pb = k.pb;
    float *sc = k.sc;
    float ob[16 * 64] __attribute__((aligned(64)));
    float zs[16];
    amx_config();
    for (long g = 0; g < ng; g++) {
        _tile_zero(0);
        for (long c = 0; c < kd; c++) {
            _tile_loadd(4, qt + 32 * c, d * 2);
            _tile_loadd(5, kp + (g * kd + c) * 256, 64);
            _tile_dpbf16ps(0, 4, 5);
        }
        _tile_stored(0, sc + 16 * g, ls * 4);
    }
    pam_softmax(a, sc, ls, pb, n32, k.i0, k.ni, k.nk, zs);
    hf_bf16 *O = a->out + k.bi * a->os[0] + k.hi * a->os[1] + k.i0 * a->os[2];
    for (long u0 = 0; u0 < vd; u0 += 4) {
        long nu = vd - u0 < 4 ? vd - u0 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (long j = 0; j < n32 / 32; j++) {
            _tile_loadd(4, pb + 32 * j, n32 * 2);
            const uint32_t *vt = vp + (j * vd + u0) * 256;
            _tile_loadd(5, vt, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (nu > 1) { _tile_loadd(6, vt + 256, 64); _tile_dpbf16ps(1, 4, 6); }
            if (nu > 2) { _tile_loadd(7, vt + 512, 64); _tile_dpbf16ps(2, 4, 7); }
            if (nu > 3) { _tile_loadd(5, vt + 768, 64); _tile_dpbf16ps(3, 4, 5); }
        }
        _tile_stored(0, ob, 256);
        if (nu > 1) _tile_stored(1, ob + 16, 256);
        if (nu > 2) _tile_stored(2, ob + 32, 256);
        if (nu > 3) _tile_stored(3, ob + 48, 256);
        pam_store(a, ob, zs, O, k.ni, u0, nu);
    }
    _tile_release();
}
#endif

#ifdef HF_PA_DPBF16
/* c[r][x] += the dword pairs of rows a[r * astride] (as bf16 pairs, broadcast) · vectors b[x * bstride] for r < 4,
 * x < g (g = 1..4, a constant where it is inlined): the 4 x 64 block of both products of pad_task, one pair of the
 * reduction dimension per call. */
static inline __attribute__((always_inline)) void pad_step(__m512 c[4][4], const uint32_t *a, long astride,
                                                           const uint32_t *b, long bstride, const int g) {
    __m512i b0 = _mm512_loadu_si512(b), b1 = g > 1 ? _mm512_loadu_si512(b + bstride) : b0,
            b2 = g > 2 ? _mm512_loadu_si512(b + 2 * bstride) : b0, b3 = g > 3 ? _mm512_loadu_si512(b + 3 * bstride) : b0;
    __asm__("" : "+v"(b0), "+v"(b1), "+v"(b2), "+v"(b3)); /* one load each (see pa_fma4x64) */
    for (int r = 0; r < 4; r++) {
        __m512bh av = (__m512bh)_mm512_set1_epi32((int)a[r * astride]);
        c[r][0] = _mm512_dpbf16_ps(c[r][0], av, (__m512bh)b0);
        if (g > 1) c[r][1] = _mm512_dpbf16_ps(c[r][1], av, (__m512bh)b1);
        if (g > 2) c[r][2] = _mm512_dpbf16_ps(c[r][2], av, (__m512bh)b2);
        if (g > 3) c[r][3] = _mm512_dpbf16_ps(c[r][3], av, (__m512bh)b3);
    }
}

/* out[r][16x + 0..16) for rows r < 16 (4 at a time), x < g: the sum over the np pairs of a (rows ap dwords apart)
 * times the packed vectors b (pair i of vector x at b + i_off(i) + x * bstride: i_off(i) = (i / 16) * bblk +
 * (i % 16) * 16 dwords, the packing's 16-pair tiles). Stored to out (ldo floats a row). */
static inline __attribute__((always_inline)) void pad_block(const uint32_t *a, long ap, const uint32_t *b,
                                                            long bstride, long bblk, long np, float *out, long ldo,
                                                            const int g) {
    for (long r0 = 0; r0 < 16; r0 += 4) {
        __m512 c[4][4];
        for (int r = 0; r < 4; r++)
            for (int x = 0; x < 4; x++) c[r][x] = _mm512_setzero_ps();
        for (long i = 0; i < np; i++)
            pad_step(c, a + r0 * ap + i, ap, b + (i / 16) * bblk + (i % 16) * 16, bstride, g);
        for (int r = 0; r < 4; r++)
            for (int x = 0; x < g; x++) _mm512_storeu_ps(out + (r0 + r) * ldo + 16 * x, c[r][x]);
    }
}

#define PAD_BLOCK_SWITCH(gx, ...)                                                                                  \
    switch (gx) {                                                                                                  \
    case 1: pad_block(__VA_ARGS__, 1); break;                                                                      \
    case 2: pad_block(__VA_ARGS__, 2); break;                                                                      \
    case 3: pad_block(__VA_ARGS__, 3); break;                                                                      \
    default: pad_block(__VA_ARGS__, 4); break;                                                                     \
    }

/* pam_task with vdpbf16ps for the tile products: the scores of 64 keys (four 16-key groups) for 4 rows at a time,
 * then p·v for 64 value columns, from the same packing (a key group's pairs and a value tile's rows are the 16-lane
 * vectors vdpbf16ps reads), the same softmax and the same rounding of p and of the output. */
static void pad_task(void *p, long t) {
    const pam_ctx *a = p;
    const pam_at k = pam_begin(a, t);
    long d = a->d, kd = d / 32, vd = a->dv / 16, ng = k.ng, n32 = k.n32, ls = k.ls;
    float ob[16 * 64] __attribute__((aligned(64)));
    float zs[16];
    /* scores: key group g's pair i (dims 2i, 2i + 1) is row i % 16 of tile (g, i / 16): kp + (g * kd + i / 16) * 256 */
    for (long g = 0; g < ng; g += 4) {
        long gx = ng - g < 4 ? ng - g : 4;
        PAD_BLOCK_SWITCH(gx, (const uint32_t *)k.qt, d / 2, k.kp + g * kd * 256, kd * 256, 256, d / 2, k.sc + 16 * g,
                         ls)
    }
    pam_softmax(a, k.sc, ls, k.pb, n32, k.i0, k.ni, k.nk, zs);
    hf_bf16 *O = a->out + k.bi * a->os[0] + k.hi * a->os[1] + k.i0 * a->os[2];
    /* p·v: key pair i (keys 2i, 2i + 1) of column block u is row i % 16 of tile (i / 16, u): vp + ((i / 16) * vd
     * + u) * 256 */
    for (long u0 = 0; u0 < vd; u0 += 4) {
        long nu = vd - u0 < 4 ? vd - u0 : 4;
        PAD_BLOCK_SWITCH(nu, (const uint32_t *)k.pb, n32 / 2, k.vp + u0 * 256, 256, vd * 256, n32 / 2, ob, 64)
        pam_store(a, ob, zs, O, k.ni, u0, nu);
    }
}
#endif

/* Unit u of the head-affine schedule (pa_schedule): (batch, kv head) u's keys and values prepared by prep (transposed
 * or packed), then every query block of the query heads that read them by task, all by one thread. Why: with the
 * preparation as a region of its own and the tasks handed out one by one, every call paid two forks of the team, and
 * a thread's tasks could read keys and values the other thread had prepared, from the other core's cache (a reading:
 * not traced); here each kv head's scratch is made and read by one thread, in one region. The tasks are the same, so
 * the bits are too (the before/after is in docs/arch/runtime.md, session 48). */
static inline void pa_unit_run(void *ctx, long u, long h, long hkv, long nqb, hf_chunk_fn prep, hf_chunk_fn task) {
    long g = h / hkv, bi = u / hkv, kh = u % hkv;
    prep(ctx, u);
    for (long hq = kh * g; hq < (kh + 1) * g; hq++)
        for (long qb = 0; qb < nqb; qb++) task(ctx, (bi * h + hq) * nqb + qb);
}

/* The prefill attention's schedule: one unit per (batch, kv head) where the threads divide them (unit runs
 * pa_unit_run), else the preparation as one region and then the tasks one by one, the largest causal blocks first. */
static void pa_schedule(void *ctx, long units, long tasks, int threads, hf_chunk_fn unit, hf_chunk_fn prep,
                        hf_chunk_fn task) {
    if (units % threads == 0) {
        hf_run_team(unit, ctx, units, threads);
    } else {
        hf_run_team(prep, ctx, units, threads);
        hf_run_team(task, ctx, tasks, threads);
    }
}

#if defined(HF_AMX) || defined(HF_PA_DPBF16)
static void pam_unit(void *p, long u) { /* pa_unit_run for the bf16-product path: pam_pack, then a->task */
    const pam_ctx *a = p;
    pa_unit_run(p, u, a->h, a->hkv, a->nqb, pam_pack, a->task);
}
#endif

/* The AMX path of hf_prefill_attention (see above): 0 done, -3 not usable here (AMX absent or refused, a mask,
 * head dims not multiples of 32 / 16), -1 no scratch memory. Same arguments as hf_prefill_attention's. */
static int hf_prefill_attention_amx(const void *q, const void *k, const void *v, const long *dims,
                                    const long *strides, int causal, float scale, int threads, void *out) {
#if defined(HF_AMX) || defined(HF_PA_DPBF16)
    long b = dims[0], d = dims[5], dv = dims[6];
    int tiles = amx_ok();
#ifndef HF_PA_DPBF16
    if (!tiles) return -3;
#endif
    (void)tiles;
    if (d % 32 || dv % 16 || d > PA_DMAX || dv > PA_DMAX) return -3;
    pam_ctx a = {q, k, v, out, NULL, NULL, NULL, 0, dims[1], dims[2], dims[3], dims[4], d, dv, 0, 0, 0,
                 {strides[0], strides[1], strides[2]}, {strides[3], strides[4], strides[5]},
                 {strides[6], strides[7], strides[8]}, {strides[13], strides[14], strides[15]}, causal, scale};
    a.nqb = (a.l + 15) / 16;
    a.sg = (a.s + 15) / 16;
    a.s32 = (a.s + 31) / 32 * 32;
    threads = clamp_threads(threads);
    size_t kw = (size_t)a.sg * (d / 32) * 256, vw = (size_t)(a.s32 / 32) * (dv / 16) * 256;
    if (b * a.h * a.l * a.s * (d + dv) < PAM_ONE_THREAD) threads = 1; /* waking the team costs more */
    /* every thread's task scratch sized for the largest block, before the tasks (a task cannot fail) */
    a.tsz = (sizeof(hf_bf16) * 16 * d + sizeof(float) * 16 * a.sg * 16 + sizeof(hf_bf16) * 16 * a.s32 + 63) / 64 * 64;
    size_t packed = sizeof(uint32_t) * b * a.hkv * (kw + vw);
    char *buf = aligned_alloc(64, (packed + a.tsz * threads + 63) / 64 * 64);
    if (!buf) return -1;
    a.kp = (uint32_t *)buf, a.vp = a.kp + b * a.hkv * kw, a.ts = buf + (packed + 63) / 64 * 64;
#if defined(HF_AMX) && defined(HF_PA_DPBF16)
    a.task = tiles ? pam_task : pad_task;
#elif defined(HF_AMX)
    a.task = pam_task;
#else
    a.task = pad_task;
#endif
    pa_schedule(&a, b * a.hkv, b * a.h * a.nqb, threads, pam_unit, pam_pack, a.task);
    free(buf);
    return 0;
#else
    (void)q, (void)k, (void)v, (void)dims, (void)strides, (void)causal, (void)scale, (void)threads, (void)out;
    return -3;
#endif
}

/* Which code hf_prefill_attention's fp32 products, softmax and key transposition run: 1 AVX-512, 2 AVX2 with FMA,
 * 0 plain C loops and expf. */
int hf_prefill_attention_simd(void) {
#if defined(__AVX512F__)
    return 1;
#elif defined(HF_ACT8)
    return 2;
#else
    return 0;
#endif
}

/* Which bf16 products hf_prefill_attention's bf16 path without a mask (bf16 == 2) runs here: 2 AMX tiles, 1
 * AVX512-BF16 dot products (pad_task), 0 neither (the widened fp32 FMAs). */
int hf_prefill_attention_bf16_products(void) {
#ifdef HF_AMX
    if (amx_ok()) return 2;
#endif
#ifdef HF_PA_DPBF16
    return 1;
#else
    return 0;
#endif
}

/* Whether a bool mask [l, s] (rows ``rs`` bytes apart, columns dense) shows key j to query i exactly when j <= i:
 * is_causal's pattern. Why: GPT-2's and Llama's exported graphs pass the causal mask as a bool tensor, shared by
 * every head, and the mask path reads it again in every head's blocks (pa_mask_block for each block, the bytes of
 * each diagonal block in pa_softmax_rows); is_causal finds the same keys from the row and column numbers. The
 * tasks then compute what they computed with the mask (the same visible keys, the same blocks skipped, the same
 * last key per block), so the bits do not change. One pass over the mask, stopping at the first difference. */
int hf_mask_is_causal(const void *mask, long l, long s, long rs) {
    const uint8_t *m = mask;
    for (long i = 0; i < l; i++, m += rs) {
        long j = 0;
#if defined(__AVX512BW__)
        for (; j + 64 <= s; j += 64) {
            __m512i row = _mm512_loadu_si512((const void *)(m + j));
            __mmask64 vis = _mm512_test_epi8_mask(row, row);
            long n = i - j + 1; /* keys of this run the row sees: j..i */
            __mmask64 want = n >= 64 ? ~(__mmask64)0 : n <= 0 ? (__mmask64)0 : (((__mmask64)1 << n) - 1);
            if (vis != want) return 0;
        }
#endif
        for (; j < s; j++)
            if ((m[j] != 0) != (j <= i)) return 0;
    }
    return 1;
}

static void pa_unit(void *p, long u) { /* pa_unit_run: pa_transpose, then pa_task */
    const pa_ctx *a = p;
    pa_unit_run(p, u, a->h, a->hkv, a->nqb, pa_transpose, pa_task);
}

/* Attention of l query rows over s keys for b x h heads (see the banner above). q [b, h, l, d], k [b, hkv, s, d],
 * v [b, hkv, s, dv] at element strides qs/ks/vs (batch, head, row; the last dim dense); mask NULL or [b, h, l, s]
 * at element strides ms (0 where broadcast), bool (mask_kind 1) or float (2); out [b, h, l, dv] at element strides
 * os (batch, head, row; the last dim dense): dense, or e.g. [b, l, h, dv] memory that a transpose makes dense.
 * strides: qs, ks, vs, ms, os (16 longs).
 * d, dv <= 256 (PA_DMAX); h a multiple of hkv. bf16: 0 fp32, 1 bf16, 2 bf16 and the bf16-product path allowed
 * (taken without a mask where d % 32 == dv % 16 == 0: on AMX tiles where AMX runs, else on AVX512-BF16 dot products
 * where the build has them; hf_prefill_attention_bf16_products). Returns 0, -1 when the key/value scratch cannot be allocated,
 * -2 for shapes outside those limits (the output is then not written). */
int hf_prefill_attention(const void *q, const void *k, const void *v, const void *mask, void *out,
                         const long *dims, const long *strides, int mask_kind, int causal, float scale,
                         int threads, int bf16) {
    pa_ctx a = {q, k, v, mask_kind ? mask : NULL, out, NULL, NULL, dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], 0, 0,
                {strides[0], strides[1], strides[2]}, {strides[3], strides[4], strides[5]},
                {strides[6], strides[7], strides[8]}, {strides[9], strides[10], strides[11], strides[12]},
                {strides[13], strides[14], strides[15]},
                mask ? mask_kind : 0, causal, scale, bf16 != 0};
    a.nqb = (a.l + PA_QB - 1) / PA_QB;
    a.sp = (a.s + PA_KB - 1) / PA_KB * PA_KB;
    if (a.d > PA_DMAX || a.dv > PA_DMAX || a.h % a.hkv || a.l < 1 || a.s < 1) return -2;
    if (a.l * a.s <= PA_SMALL) {
        pa_small(&a, dims[0]);
        return 0;
    }
    if (bf16 == 2 && !a.mask) { /* bf16 without a mask, AMX allowed: the tile path where it runs */
        int rc = hf_prefill_attention_amx(q, k, v, dims, strides, causal, scale, threads, out);
        if (rc != -3) return rc;
    }
    if (a.mask_kind == 1 && a.ms[3] == 1 && (dims[0] == 1 || a.ms[0] == 0) && (a.h == 1 || a.ms[1] == 0) && !causal
        && hf_mask_is_causal(a.mask, a.l, a.s, a.ms[2]))
        a.mask = NULL, a.mask_kind = 0, a.causal = 1; /* the same visible keys, found by position (hf_mask_is_causal) */
    /* the key/value scratch: kept per calling thread up to PA_KEEP bytes (a fresh block of that size is an mmap
     * and its page faults on every call, which a short prefill or one-token forward notices), else per call */
    size_t need = sizeof(float) * dims[0] * a.hkv * (a.d * a.sp + a.s * a.dv);
    static _Thread_local hf_scratch kept;
    a.kt = scratch_get(&kept, need, PA_KEEP);
    if (!a.kt) return -1;
    a.vp = a.kt + dims[0] * a.hkv * a.d * a.sp;
    /* a few thousand products (a one-token forward, a short chunk): waking the team costs more than they do */
    if (dims[0] * a.h * a.l * a.s * (a.d + a.dv) < (1L << 20)) threads = 1;
    pa_schedule(&a, dims[0] * a.hkv, dims[0] * a.h * a.nqb, clamp_threads(threads), pa_unit, pa_transpose, pa_task);
    scratch_done(&kept, a.kt);
    return 0;
}

/* ---------------------------------------------------------------- per-channel int8 weight quantization
 * Why: quantizing a model's weights for w8 / w8a8 through ATen (quant.schemes.quantize_int8 and the error its
 * report gives) is about a dozen whole-weight passes (abs, max, divide, round, clamp, cast, then dequantize,
 * subtract and two norms), each writing a weight-sized temporary: most of a quantized model's first compile.
 * Here a chunk of QI8_CH output channels is read twice (its channels' max |w|, then the int8 values and the
 * error), with quantize_int8's float ops: s = max|w| / 127 raised to (float)1e-12, q = w / s rounded half to
 * even (nearbyintf in the default mode, as torch.round) and clamped to ±127, so q and s have its bits. Layout:
 * w is [n, k] row-major (kn = 0), or [k, n] row-major (kn = 1: a Conv1D weight, channel j is column j); q is
 * [n, k] either way. Each chunk adds Σ(w - q·s)² and Σw² (the dequantized value in float, the sums in double)
 * into its own slot of err / nrm, so the sums do not depend on which thread ran a chunk.
 * Returns 1, with q and s incomplete, when w holds a NaN or ±Inf (the caller falls back to ATen), else 0. */
#define QI8_CH 16
typedef struct {
    const float *w;
    long n, k;
    int kn;
    int8_t *q;
    float *s;
    double *err, *nrm;
    _Atomic int bad;
} qi8_ctx;

static inline int8_t qi8_round(float v, float s) {
    float r = nearbyintf(v / s);
    return (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
}

static void qi8_chunk(void *p, long c) {
    qi8_ctx *a = p;
    long n0 = c * QI8_CH, n1 = n0 + QI8_CH < a->n ? n0 + QI8_CH : a->n, w = n1 - n0, k = a->k;
    float amax[QI8_CH] = {0}, s[QI8_CH];
    int finite = 1;
    if (!a->kn) {
        for (long j = 0; j < w; j++) {
            const float *r = a->w + (n0 + j) * k;
            float m = 0.f;
            for (long i = 0; i < k; i++) {
                float v = fabsf(r[i]);
                finite &= v <= 3.40282347e38f;
                m = v > m ? v : m;
            }
            amax[j] = m;
        }
    } else {
        for (long i = 0; i < k; i++) {
            const float *r = a->w + i * a->n + n0;
            for (long j = 0; j < w; j++) {
                float v = fabsf(r[j]);
                finite &= v <= 3.40282347e38f;
                amax[j] = v > amax[j] ? v : amax[j];
            }
        }
    }
    if (!finite) {
        atomic_store(&a->bad, 1);
        return;
    }
    const float tiny = (float)1e-12;
    for (long j = 0; j < w; j++) {
        float d = amax[j] / 127.f;
        s[j] = d < tiny ? tiny : d;
        a->s[n0 + j] = s[j];
    }
    double err = 0., nrm = 0.;
    if (!a->kn) {
        for (long j = 0; j < w; j++) {
            const float *r = a->w + (n0 + j) * k;
            int8_t *q = a->q + (n0 + j) * k;
            for (long i = 0; i < k; i++) {
                int8_t qi = qi8_round(r[i], s[j]);
                float e = r[i] - (float)qi * s[j];
                q[i] = qi;
                err += (double)e * e, nrm += (double)r[i] * r[i];
            }
        }
    } else {
        for (long i = 0; i < k; i++) {
            const float *r = a->w + i * a->n + n0;
            for (long j = 0; j < w; j++) {
                int8_t qi = qi8_round(r[j], s[j]);
                float e = r[j] - (float)qi * s[j];
                a->q[(n0 + j) * k + i] = qi;
                err += (double)e * e, nrm += (double)r[j] * r[j];
            }
        }
    }
    a->err[c] = err, a->nrm[c] = nrm;
}

long hf_quantize_i8_chunks(long n) { return (n + QI8_CH - 1) / QI8_CH; }

int hf_quantize_i8(const float *w, long n, long k, int kn, int8_t *q, float *s, double *err, double *nrm, int threads) {
    qi8_ctx a = {w, n, k, kn, q, s, err, nrm, 0};
    hf_run(qi8_chunk, &a, hf_quantize_i8_chunks(n), clamp_threads(threads));
    return atomic_load(&a.bad) ? 1 : 0;
}

/* ---------------------------------------------------------------- weight transpose
 * dst[n, k] = src[k, n] for elements of 4 or 2 bytes, in tiles of 32 source rows by TR_J columns (each tile's reads
 * and writes stay in L1), one chunk per band of TR_J destination rows; 4-byte tiles move as 8 x 8 register blocks
 * where AVX2 is there. Why: packing a [K, N]-stored weight (GPT-2's Conv1D) for oneDNN first needs its [N, K]
 * rows, and ATen's copy of a transposed view walks one of the two sides with a stride of a whole row per element.
 * A band of 128 reads 512 contiguous bytes per source row (32 read one 128-byte run per page). */
#define TR_T 32
#define TR_J 128
typedef struct { const char *src; char *dst; long k, n; int size; } tr_ctx;

#if defined(__AVX2__)
/* d[b * ld + a] = s[a * ls + b] for an 8 x 8 block of floats, in registers (unpack, shuffle, lane swap). */
static inline void tr8x8(const float *s, long ls, float *d, long ld) {
    __m256 r0 = _mm256_loadu_ps(s), r1 = _mm256_loadu_ps(s + ls), r2 = _mm256_loadu_ps(s + 2 * ls),
           r3 = _mm256_loadu_ps(s + 3 * ls), r4 = _mm256_loadu_ps(s + 4 * ls), r5 = _mm256_loadu_ps(s + 5 * ls),
           r6 = _mm256_loadu_ps(s + 6 * ls), r7 = _mm256_loadu_ps(s + 7 * ls);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
           t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
           t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)), u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2)),
           u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)), u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2)),
           u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0)), u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2)),
           u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0)), u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    _mm256_storeu_ps(d, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(d + ld, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(d + 2 * ld, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(d + 3 * ld, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(d + 4 * ld, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(d + 5 * ld, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(d + 6 * ld, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(d + 7 * ld, _mm256_permute2f128_ps(u3, u7, 0x31));
}
#endif

static void tr_chunk(void *vctx, long c) {
    const tr_ctx *a = vctx;
    long j0 = c * TR_J, j1 = j0 + TR_J < a->n ? j0 + TR_J : a->n;
    for (long i0 = 0; i0 < a->k; i0 += TR_T) {
        long i1 = i0 + TR_T < a->k ? i0 + TR_T : a->k;
#if defined(__AVX2__)
        if (a->size == 4 && (j1 - j0) % 8 == 0 && i1 - i0 == TR_T) { /* whole 8 x 8 blocks, in registers */
            const float *s = (const float *)a->src;
            float *d = (float *)a->dst;
            for (long j = j0; j < j1; j += 8)
                for (long i = i0; i < i1; i += 8) tr8x8(s + i * a->n + j, a->n, d + j * a->k + i, a->k);
            continue;
        }
#endif
        if (a->size == 4) {
            const float *s = (const float *)a->src;
            float *d = (float *)a->dst;
            for (long j = j0; j < j1; j++)
                for (long i = i0; i < i1; i++) d[j * a->k + i] = s[i * a->n + j];
        } else {
            const uint16_t *s = (const uint16_t *)a->src;
            uint16_t *d = (uint16_t *)a->dst;
            for (long j = j0; j < j1; j++)
                for (long i = i0; i < i1; i++) d[j * a->k + i] = s[i * a->n + j];
        }
    }
}

/* 0, or -1 for an element size other than 2 or 4. */
int hf_transpose(const void *src, void *dst, long k, long n, int size, int threads) {
    if (size != 4 && size != 2) return -1;
    tr_ctx a = {src, dst, k, n, size};
    hf_run(tr_chunk, &a, (n + TR_J - 1) / TR_J, clamp_threads(threads));
    return 0;
}

/* ---------------------------------------------------------------- few-row products
 * Y[m, n] = act(X[m, :] · W[n, :] + b[n]) for a handful of rows of X (a short prefill or chunk: m <= HF_FEW_MAX),
 * W [N, K] row-major. Why: at a few rows a product still streams the whole weight from memory, and oneDNN's packed
 * GEMM read it at about half the rate the one-row GEMV above reaches (docs/arch/runtime.md). This reads W as the
 * GEMV does (four streams, the same chunks), and each group of four weight rows, once loaded, is multiplied with
 * every row of X in blocks of four (16 accumulators, FMA), the X rows coming from cache. */
#define HF_FEW_MAX 32
typedef struct {
    const float *w, *x, *bias;
    float *y, *part; /* part: hf_gemm_few_kn's split-K blocks */
    long m, n, k, rows;
    int act, chunks;
} few_ctx;

static void few_block(const float *restrict w0, const float *restrict w1, const float *restrict w2,
                      const float *restrict w3, const float *restrict x, long mb, long k, float out[4][4]) {
    long i = 0;
#if defined(__AVX512F__)
    __m512 s[4][4];
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 4; j++) s[r][j] = _mm512_setzero_ps();
    const float *xr[4];
    for (int r = 0; r < 4; r++) xr[r] = x + (r < mb ? r : 0) * k;
    for (; i + HF_LANES <= k; i += HF_LANES) {
        __m512 a0 = _mm512_loadu_ps(w0 + i), a1 = _mm512_loadu_ps(w1 + i), a2 = _mm512_loadu_ps(w2 + i),
               a3 = _mm512_loadu_ps(w3 + i);
        for (int r = 0; r < 4; r++) {
            __m512 xv = _mm512_loadu_ps(xr[r] + i);
            s[r][0] = _mm512_fmadd_ps(a0, xv, s[r][0]);
            s[r][1] = _mm512_fmadd_ps(a1, xv, s[r][1]);
            s[r][2] = _mm512_fmadd_ps(a2, xv, s[r][2]);
            s[r][3] = _mm512_fmadd_ps(a3, xv, s[r][3]);
        }
    }
    if (i < k) {
        __mmask16 msk = (__mmask16)((1u << (k - i)) - 1);
        __m512 a0 = _mm512_maskz_loadu_ps(msk, w0 + i), a1 = _mm512_maskz_loadu_ps(msk, w1 + i),
               a2 = _mm512_maskz_loadu_ps(msk, w2 + i), a3 = _mm512_maskz_loadu_ps(msk, w3 + i);
        for (int r = 0; r < 4; r++) {
            __m512 xv = _mm512_maskz_loadu_ps(msk, xr[r] + i);
            s[r][0] = _mm512_fmadd_ps(a0, xv, s[r][0]);
            s[r][1] = _mm512_fmadd_ps(a1, xv, s[r][1]);
            s[r][2] = _mm512_fmadd_ps(a2, xv, s[r][2]);
            s[r][3] = _mm512_fmadd_ps(a3, xv, s[r][3]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 4; j++) out[r][j] = hsum16(s[r][j]);
#else
    (void)i;
    for (int r = 0; r < 4 && r < mb; r++) dot4(w0, w1, w2, w3, x + r * k, k, out[r]);
#endif
}

static void few_chunk(void *p, long c) {
    const few_ctx *a = p;
    long n = a->n, k = a->k, q = n / 4, i0 = c * a->rows, i1 = i0 + a->rows < q ? i0 + a->rows : q;
    const float *w = a->w;
    if (i0 >= q) { /* the tail rows */
        for (long r = 4 * q; r < n; r++)
            for (long mm = 0; mm < a->m; mm++) {
                float v = dot1(w + r * k, a->x + mm * k, k);
                a->y[mm * n + r] = act_of(a->bias ? v + a->bias[r] : v, a->act);
            }
        return;
    }
    float o[4][4];
    for (long i = i0; i < i1; i++) {
        const float *w0 = w + i * k, *w1 = w + (i + q) * k, *w2 = w + (i + 2 * q) * k, *w3 = w + (i + 3 * q) * k;
        for (long m0 = 0; m0 < a->m; m0 += 4) {
            long mb = a->m - m0 < 4 ? a->m - m0 : 4;
            few_block(w0, w1, w2, w3, a->x + m0 * k, mb, k, o);
            for (long r = 0; r < mb; r++)
                for (int j = 0; j < 4; j++) {
                    long col = i + j * q;
                    a->y[(m0 + r) * n + col] = act_of(a->bias ? o[r][j] + a->bias[col] : o[r][j], a->act);
                }
        }
    }
}

/* 0, or -2 for a row count outside 1..HF_FEW_MAX (nothing written). */
int hf_gemm_few(const float *w, const float *x, const float *bias, float *y, long m, long n, long k, int act,
                int threads) {
    if (m < 1 || m > HF_FEW_MAX) return -2;
    few_ctx a = {w, x, bias, y, 0, m, n, k, rows_per_chunk(k * (long)sizeof(float)), act, 0};
    hf_run(few_chunk, &a, four_stream_chunks(n, a.rows), clamp_threads(threads));
    return 0;
}


/* A gated MLP of m <= HF_FEW_MAX rows: h = act(X Wg^T) * (X Wu^T), then Y = h Wd^T (Y = h without Wd); g and h are
 * [m, f] scratch. Wg, Wu [F, D], Wd [D, F], row-major, each read as hf_gemm_few reads a weight. */
int hf_gated_mlp_few(const float *x, const float *wg, const float *wu, const float *wd, float *g, float *h,
                     float *y, long m, long f, long d, int act, int threads) {
    if (m < 1 || m > HF_FEW_MAX) return -2;
    hf_gemm_few(wg, x, 0, g, m, f, d, ACT_NONE, threads);
    hf_gemm_few(wu, x, 0, wd ? h : y, m, f, d, ACT_NONE, threads);
    float *hv = wd ? h : y;
    for (long i = 0; i < m * f; i++) hv[i] = act_of(g[i], act) * hv[i];
    if (wd) hf_gemm_few(wd, h, 0, y, m, d, f, ACT_NONE, threads);
    return 0;
}

/* The same product for W stored [K, N] (GPT-2's Conv1D): Y[m, n] = act(sum_k X[m, k] W[k, n] + b[n]), split over K
 * as hf_gemv_kn is: part c streams rows [c*r, (c+1)*r) of each quarter of W (four streams) into its own [m, N]
 * block of ``part``, then the parts are summed in part order (so the result depends on neither the thread count
 * nor timing). Within a part, each group of four weight rows is multiplied with every row of X in blocks of four
 * (16 broadcast x values held in registers, four rows of running sums loaded and stored per 16 columns); the
 * group's rows come from memory for the first block and from cache for the others. */
static void few_kn_partial(void *p, long c) {
    const few_ctx *a = p;
    long n = a->n, k = a->k, m = a->m, q = k / 4, r = (q + a->chunks - 1) / a->chunks;
    long i0 = c * r < q ? c * r : q, i1 = i0 + r < q ? i0 + r : q;
    float *restrict acc = a->part + (size_t)c * m * n;
    memset(acc, 0, (size_t)m * n * sizeof(float));
    for (long i = i0; i < i1; i++) {
        const float *restrict w0 = a->w + i * n, *restrict w1 = w0 + q * n;
        const float *restrict w2 = w1 + q * n, *restrict w3 = w2 + q * n;
        for (long m0 = 0; m0 < m; m0 += 4) {
            long mb = m - m0 < 4 ? m - m0 : 4;
            long j = 0;
#if defined(__AVX512F__)
            if (mb == 4) {
                __m512 xv[4][4];
                for (int rr = 0; rr < 4; rr++) {
                    const float *xr = a->x + (m0 + rr) * k;
                    xv[rr][0] = _mm512_set1_ps(xr[i]), xv[rr][1] = _mm512_set1_ps(xr[i + q]);
                    xv[rr][2] = _mm512_set1_ps(xr[i + 2 * q]), xv[rr][3] = _mm512_set1_ps(xr[i + 3 * q]);
                }
                for (; j + HF_LANES <= n; j += HF_LANES) {
                    __m512 b0 = _mm512_loadu_ps(w0 + j), b1 = _mm512_loadu_ps(w1 + j), b2 = _mm512_loadu_ps(w2 + j),
                           b3 = _mm512_loadu_ps(w3 + j);
                    for (int rr = 0; rr < 4; rr++) {
                        float *ar = acc + (m0 + rr) * n + j;
                        __m512 s = _mm512_loadu_ps(ar);
                        s = _mm512_fmadd_ps(xv[rr][0], b0, s);
                        s = _mm512_fmadd_ps(xv[rr][1], b1, s);
                        s = _mm512_fmadd_ps(xv[rr][2], b2, s);
                        s = _mm512_fmadd_ps(xv[rr][3], b3, s);
                        _mm512_storeu_ps(ar, s);
                    }
                }
            }
#endif
            for (long rr = 0; rr < mb; rr++) {
                const float *xr = a->x + (m0 + rr) * k;
                const float x0 = xr[i], x1 = xr[i + q], x2 = xr[i + 2 * q], x3 = xr[i + 3 * q];
                float *restrict ar = acc + (m0 + rr) * n;
                for (long jj = j; jj < n; jj++) ar[jj] += x0 * w0[jj] + x1 * w1[jj] + x2 * w2[jj] + x3 * w3[jj];
            }
        }
    }
    if (c == a->chunks - 1)
        for (long i = 4 * q; i < k; i++)
            for (long mm = 0; mm < m; mm++) {
                const float xi = a->x[mm * k + i];
                const float *restrict wr = a->w + i * n;
                float *restrict ar = acc + mm * n;
                for (long j = 0; j < n; j++) ar[j] += xi * wr[j];
            }
}

/* Row c of Y: the sum of the parts' row c, in part order, then bias and activation. */
static void few_kn_reduce(void *p, long c) {
    const few_ctx *a = p;
    long n = a->n;
    float *restrict y = a->y + c * n;
    const float *p0 = a->part + c * n;
    for (long j = 0; j < n; j++) y[j] = p0[j];
    for (int cc = 1; cc < a->chunks; cc++) {
        const float *restrict pc = a->part + ((size_t)cc * a->m + c) * n;
#pragma omp simd
        for (long j = 0; j < n; j++) y[j] += pc[j];
    }
    for (long j = 0; j < n; j++) y[j] = act_of(a->bias ? y[j] + a->bias[j] : y[j], a->act);
}

/* ``part``: a scratch of ``slots`` x m x N floats the caller owns (the number of parts, at most: kn_parts).
 * 0, or -2 for a row count outside 1..HF_FEW_MAX (nothing written). */
int hf_gemm_few_kn(const float *w, const float *x, const float *bias, float *y, long m, long n, long k, int act,
                   int threads, float *part, int slots) {
    if (m < 1 || m > HF_FEW_MAX) return -2;
    few_ctx a = {w, x, bias, y, part, m, n, k, 0, act, kn_parts(k, slots)};
    threads = clamp_threads(threads);
    hf_run(few_kn_partial, &a, a.chunks, threads);
    hf_run(few_kn_reduce, &a, m, threads);
    return 0;
}

/* ---------------------------------------------------------------- panel GEMM (a short prompt's products)
 * Y[m, n] = X[m, k] W^T + b for fp32, on a weight packed once into panels of HF_PNB output columns:
 * P[j][kk][c] = W[j*HF_PNB + c][kk] (zero past N). Why: a prompt of a few dozen tokens still streams every weight
 * from memory once, and the packed GEMMs torch ships (MKL's, oneDNN's) read it below the memory's speed at these
 * row counts (measured: bench/panel_gemm.py). How the panel is read decides the speed:
 *  - as HF_PSTREAMS interleaved streams (the k-rows [s*Q, (s+1)*Q) for s < HF_PSTREAMS, Q = ceil(k / HF_PSTREAMS),
 *    one k-row of each in turn), prefetched into L1: one stream per core leaves memory bandwidth unused, as for
 *    the one-row products (dot4). One row group (m <= HF_PMR) prefetches HF_PPF bytes ahead of its reads; with
 *    several, every group prefetches its share (every ng-th k-row step) of the next block's k-rows while it runs
 *    over this block, so the next block's reads overlap all the groups' arithmetic, not only the first group's
 *    (which alone prefetched before, so the later groups ran from L1 with memory idle: the same products took
 *    1.12-1.20x the time at 16-32 rows over 1024/4096-wide weights read from memory, a one-off in
 *    docs/arch/runtime.md). In a panel's last block the prefetches go to the first block of the panel the chunk
 *    runs next, every stream of it (panel_block's pnext): before, they ran past each stream's end into k-rows
 *    already read, and three of the next panel's four streams started unprefetched (bench/kernel_ab.py --groups
 *    panel: 0.98 of the time at 32 rows, 0.99 at 64, level at 128; session 47);
 *  - once from memory for every row count: the k-rows are taken in blocks of HF_PKB steps (24 KiB of panel), and
 *    every HF_PMR-row group of X runs over a block while it is in L1 (8 x 48 accumulators in registers, saved to
 *    a contiguous scratch between blocks: panel_chunk), so a second row group no longer re-reads the panel after
 *    the first has streamed all of it. Blocks of 32 steps rather than 16 halve the accumulators' saves and
 *    reloads (1-2% on 128-row products of the calibration shapes, level at 32 rows; up to 16 rows blocks of 16
 *    steps and session 33's loop stay: docs/arch/runtime.md, session 34).
 * Each output element is one chain of fused multiply-adds from the bias in that stream-interleaved k order, on
 * the AVX-512 path and on the plain C one alike (fmaf), so a result does not depend on the path, the thread count
 * or the chunking. The first block starts the accumulators from the bias in registers (an earlier version first
 * wrote the bias into every output row in a scalar pass before the products), a row
 * group takes its epilogue (act, mul, res) right after its last block, while its sums are still in L1, and the
 * panel's three k-row vectors are held in registers (left to itself the compiler re-read them from L1 in every
 * row's multiply-add, 32 loads per 24 multiply-adds, which made the loop load-bound). The panels are split into
 * chunks run on torch's OpenMP team (as the other multi-row kernels, hf_run_team): runs of HF_PCHUNK panels that
 * divide evenly among the threads, then each panel left over in row slices (panel_span); where that does not apply,
 * nc contiguous ranges of near-equal length (nc a multiple of the thread count, about HF_PCHUNK panels each; fixed
 * chunks of HF_PCHUNK left one thread 24 panels and the other 19 for N = 2048). */
#define HF_PNB 48
#define HF_PMR 8
#define HF_PCHUNK 4
#define HF_PSTREAMS 4
/* k-steps per block from three row groups (see the header); on the AVX2 path 16, for the reason given below for
 * fewer groups (32: 1.02-1.03x the time at 24-32 rows from memory, level at 64-128, session 58) */
#if defined(__AVX512F__)
#define HF_PKB 32
#else
#define HF_PKB 16
#endif
/* k-steps per block for one or two row groups (panel_block). On the AVX2 path a group's passes read the block
 * from L1 while the next block is prefetched into it, so the two must fit there: blocks of 16 steps (12 KiB each)
 * took 1.10-1.20x the time of blocks of 8 at 8-16 rows, and one group ran faster still with 4 (bench/kernel_ab.py
 * --groups panel on calibration widths; docs/arch/runtime.md). */
#if defined(__AVX512F__)
#define HF_PKB_FEW(ng) 16
#else
#define HF_PKB_FEW(ng) ((ng) == 1 ? 4 : 8)
#endif
#define HF_PPF 2048
#define HF_PSUP 128
#define HF_PSLICE_ROWS 32 /* the fewest rows of a row slice of a panel (panel_span) */
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define HF_PSEG 4 /* products of one input in one call at most (hf_gemm_panel_multi) */
typedef struct {
    const float *x;         /* X packed (panel_pack_x) */
    long m, k;
    int nseg;               /* segment s: a weight's panels p[s] (global panels [j0[s], j0[s + 1])), its bias and Y */
    const float *p[HF_PSEG], *bias[HF_PSEG];
    float *y[HF_PSEG];
    long n[HF_PSEG], j0[HF_PSEG + 1];
    int act;                /* ACT_* applied to each sum (hf_epilogue_act), then */
    const float *mul, *res; /* times mul[r, c], then plus res[r, c] ([m, n] dense; NULL: none; one segment only) */
    long nc;                /* chunks: panel_span gives each one's panels and rows */
    long ncm, npm;          /* the first ncm chunks: the first npm panels, HF_PCHUNK each, every row */
    int slices;             /* then each of the last np - npm panels in this many row slices, a chunk apiece */
    int gated;              /* one segment, no mul: Y = act(X Wg^T + bg) * (X Wu^T + bu) (+ res), p[0] / bias[0] the */
    const float *pu, *bu;   /* gate's panels and bias, pu / bu the up product's (panel_chunk_gated) */
} panel_ctx;

/* Whether this build has a vector path, AVX-512 or AVX2 with FMA (the plain C path is for correctness, not speed). */
int hf_panel_simd(void) {
#if defined(__AVX512F__) || defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* Pack W ([N, K] rows, or [K, N] when weight_t) into ceil(N / HF_PNB) panels of k x HF_PNB floats at p. */
typedef struct {
    const float *w;
    float *p;
    long n, k;
    int weight_t;
} panel_pack_ctx;

static void panel_pack_chunk(void *ctx, long j) {
    const panel_pack_ctx *a = ctx;
    long n = a->n, k = a->k;
    float *restrict dst = a->p + (size_t)j * k * HF_PNB;
    long c0 = j * HF_PNB, nv = n - c0 < HF_PNB ? n - c0 : HF_PNB;
    if (a->weight_t) {
        for (long kk = 0; kk < k; kk++) {
            memcpy(dst + kk * HF_PNB, a->w + (size_t)kk * n + c0, (size_t)nv * sizeof(float));
            for (long c = nv; c < HF_PNB; c++) dst[kk * HF_PNB + c] = 0.f;
        }
    } else {
        long c = 0;
#if defined(__AVX2__)
        long kb = k - k % 8; /* k-rows [0, kb) of 8-column blocks by register transposes, the rest one by one below */
        for (; c + 8 <= nv; c += 8)
            for (long kk = 0; kk < kb; kk += 8) tr8x8(a->w + (size_t)(c0 + c) * k + kk, k, dst + kk * HF_PNB + c, HF_PNB);
        for (long cb = 0; cb < c; cb++)
            for (long kk = kb; kk < k; kk++) dst[kk * HF_PNB + cb] = a->w[(size_t)(c0 + cb) * k + kk];
#endif
        for (; c < HF_PNB; c++) {
            const float *src = a->w + (size_t)(c0 + c) * k;
            if (c < nv)
                for (long kk = 0; kk < k; kk++) dst[kk * HF_PNB + c] = src[kk];
            else
                for (long kk = 0; kk < k; kk++) dst[kk * HF_PNB + c] = 0.f;
        }
    }
}

void hf_pack_panels(const float *w, float *p, long n, long k, int weight_t, int threads) {
    panel_pack_ctx a = {w, p, n, k, weight_t != 0};
    hf_run_team(panel_pack_chunk, &a, (n + HF_PNB - 1) / HF_PNB, clamp_threads(threads));
}

/* Row group xp (X's HF_PMR rows packed k-row by k-row: xp[kk * HF_PMR + r], rows past m zero) over the stream
 * steps [i0, i1) of panel pan, accumulating into acc (ldo floats per row, HF_PNB columns, holding the sums so far;
 * only its first mr rows are read and written). ``g``: this group's index among the call's ``ng`` groups, which
 * decides its share of the prefetches (see the header above). The packed rows let every broadcast use a constant
 * offset and keep all 24 accumulators in registers. */
#if defined(__AVX512F__) || defined(__AVX2__)
/* A panel k-row (HF_PNB floats: three lines) at f into L1. */
static inline void panel_prefetch(const char *f) {
    _mm_prefetch(f, _MM_HINT_T0);
    _mm_prefetch(f + 64, _MM_HINT_T0);
    _mm_prefetch(f + 128, _MM_HINT_T0);
}
#endif

#if defined(__AVX512F__)
/* One k-row step of a row group: the panel's three k-row vectors times the group's 8 X values into a[8][3]. */
static inline __attribute__((always_inline)) void panel_step(__m512 a[HF_PMR][3], const float *bs, const float *xs) {
    __m512 b0 = _mm512_loadu_ps(bs), b1 = _mm512_loadu_ps(bs + 16), b2 = _mm512_loadu_ps(bs + 32);
    __asm__("" : "+v"(b0), "+v"(b1), "+v"(b2)); /* keep B in registers: one load each, not one per row */
#pragma GCC unroll 8
    for (int r = 0; r < HF_PMR; r++) {
        __m512 xb = _mm512_set1_ps(xs[r]);
        a[r][0] = _mm512_fmadd_ps(xb, b0, a[r][0]);
        a[r][1] = _mm512_fmadd_ps(xb, b1, a[r][1]);
        a[r][2] = _mm512_fmadd_ps(xb, b2, a[r][2]);
    }
}
#endif

static void panel_block(const float *xp, long k, long q, const float *pan, long i0, long i1, int mr, float *acc,
                        long ldo, int g, int ng, const float *init, long kb, const float *pnext) {
    /* what the block prefetches for step i of stream s: pfb + (s * q + i) k-rows: the same k-row of the next block;
     * in a panel's last block, when the caller names the panel it runs next (pnext), that panel's first block */
    const int last = i1 >= q && pnext;
    const char *pfb = (const char *)(last ? pnext - i0 * HF_PNB : pan + kb * HF_PNB);
#if defined(__AVX512F__)
    __m512 a[HF_PMR][3];
    if (init) {
        __m512 i0v = _mm512_loadu_ps(init), i1v = _mm512_loadu_ps(init + 16), i2v = _mm512_loadu_ps(init + 32);
        for (int r = 0; r < HF_PMR; r++) a[r][0] = i0v, a[r][1] = i1v, a[r][2] = i2v;
    } else
    for (int r = 0; r < HF_PMR; r++) {
        int live = r < mr;
        a[r][0] = live ? _mm512_loadu_ps(acc + r * ldo) : _mm512_setzero_ps();
        a[r][1] = live ? _mm512_loadu_ps(acc + r * ldo + 16) : _mm512_setzero_ps();
        a[r][2] = live ? _mm512_loadu_ps(acc + r * ldo + 32) : _mm512_setzero_ps();
    }
    if (ng <= 2) {
        /* One or two row groups (up to 16 rows, a weight-read-bound product): session 33's loop, each stream step
         * in turn prefetching when its turn comes (every step for one group; every other for two), with blocks of
         * HF_PKB_FEW steps. Programs of 16 rows ran 3-7% slower with the loop below and blocks of 32, and this one
         * recovers them (docs/arch/runtime.md, session 34); the loop below is faster from 24 rows. */
        int turn = 0;
        for (long i = i0; i < i1; i++)
            for (int s = 0; s < HF_PSTREAMS; s++) {
                long kk = s * q + i;
                if (kk >= k) break;
                const float *b = pan + kk * HF_PNB;
                if (turn == g) { /* one group: HF_PPF bytes ahead; two: this stream's k-row of the next block */
                    panel_prefetch(ng == 1 && !last ? (const char *)b + HF_PPF
                                                    : pfb + kk * HF_PNB * (long)sizeof(float));
                }
                turn = turn + 1 == ng ? 0 : turn + 1;
                panel_step(a, b, xp + kk * HF_PMR);
            }
    } else {
        /* Which steps prefetch: this group takes the steps i = i0 + g, i0 + g + ng, ..., each for all the streams'
         * k-rows, so the groups between them cover the next block once; a counter, not a modulo, and nothing kept
         * across the streams (a counter carried from stream to stream lived on the stack: a store and a reload each
         * step; 1-2% of the time at 128 rows). */
        long pfi = i0 + g;
        const long sb = q * HF_PNB, sx = q * HF_PMR; /* one stream's k-rows to the next's, in floats */
        const long full = k - (HF_PSTREAMS - 1) * q; /* steps i < full have a k-row in every stream */
        for (long i = i0; i < i1; i++) {
            const float *b = pan + i * HF_PNB, *xv = xp + i * HF_PMR;
            int ns = HF_PSTREAMS;
            if (i >= full)
                for (ns = 0; ns < HF_PSTREAMS && ns * q + i < k; ns++) {}
            if (i == pfi) {
                for (int s = 0; s < ns; s++) panel_prefetch(pfb + (s * sb + i * HF_PNB) * (long)sizeof(float));
                pfi += ng;
            }
#pragma GCC unroll 4
            for (int s = 0; s < HF_PSTREAMS; s++) {
                if (s >= ns) break;
                panel_step(a, b + s * sb, xv + s * sx);
            }
        }
    }
    for (int r = 0; r < HF_PMR; r++)
        if (r < mr) {
            _mm512_storeu_ps(acc + r * ldo, a[r][0]);
            _mm512_storeu_ps(acc + r * ldo + 16, a[r][1]);
            _mm512_storeu_ps(acc + r * ldo + 32, a[r][2]);
        }
#elif defined(__AVX2__) && defined(__FMA__)
    /* AVX2's 16 registers cannot hold a group's HF_PMR x HF_PNB sums (48 vectors of 8): the block runs in passes of
     * 4 rows x 24 columns (12 sums, 3 panel vectors and a broadcast), each over the block's steps in the order above
     * (step, then stream), so every output is the same chain of multiply-adds as the other paths'. The panel block
     * is read once per pass, from L1 after the first. The next block's k-rows (or pnext's first block's) are
     * fetched by all the block's passes in turn, step by step: pass lp of group g takes the steps i0 + g * gp + lp,
     * then every np_ steps (a group with fewer passes than gp takes its missing passes' steps too). Until session
     * 58 only the first pass of each group fetched, a burst of prefetches while the other passes ran with memory
     * idle: products of 8-32 rows from memory took 1.10-1.25x the time (bench/kernel_ab.py --groups panel). */
    const int gp = 2 * (HF_PMR / 4), np_ = ng * gp, lpn = 2 * ((mr + 3) / 4); /* passes: a full group's, the
                                                                                 * block's, this group's */
    for (int h = 0; h < HF_PNB; h += 24)
        for (int r0 = 0; r0 < mr; r0 += 4) {
            __m256 c[4][3];
            for (int r = 0; r < 4; r++)
                for (int x = 0; x < 3; x++)
                    c[r][x] = init ? _mm256_loadu_ps(init + h + 8 * x)
                              : r0 + r < mr ? _mm256_loadu_ps(acc + (r0 + r) * ldo + h + 8 * x) : _mm256_setzero_ps();
            /* this pass prefetches the steps i0 + g * gp + lp (+ lpn where a short group has fewer passes than
             * gp), then every np_ steps: strides st[0], st[1] in turn */
            const int lp = (h / 24) * (lpn / 2) + r0 / 4;
            const long st[2] = {lpn < gp ? lpn : np_, lpn < gp ? np_ - lpn : np_};
            long pfi = i0 + g * gp + lp;
            int t = 0;
            const long sb = q * HF_PNB, sx = q * HF_PMR; /* one stream's k-rows to the next's, in floats */
            const long full = k - (HF_PSTREAMS - 1) * q; /* steps i < full have a k-row in every stream */
            for (long i = i0; i < i1; i++) {
                if (i == pfi) {
                    for (int s = 0; s < HF_PSTREAMS && s * q + i < k; s++)
                        panel_prefetch(pfb + (s * q + i) * HF_PNB * (long)sizeof(float));
                    pfi += st[t], t ^= 1;
                }
                const float *bi = pan + i * HF_PNB + h, *xi = xp + i * HF_PMR + r0;
                int ns = HF_PSTREAMS;
                if (i >= full)
                    for (ns = 0; ns < HF_PSTREAMS && ns * q + i < k; ns++) {}
#pragma GCC unroll 4
                for (int s = 0; s < HF_PSTREAMS; s++) {
                    if (s >= ns) break;
                    const float *b = bi + s * sb, *xs = xi + s * sx;
                    __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8), b2 = _mm256_loadu_ps(b + 16);
                    __asm__("" : "+x"(b0), "+x"(b1), "+x"(b2)); /* one load each, as in panel_step */
                    for (int r = 0; r < 4; r++) {
                        __m256 xb = _mm256_broadcast_ss(xs + r);
                        c[r][0] = _mm256_fmadd_ps(xb, b0, c[r][0]);
                        c[r][1] = _mm256_fmadd_ps(xb, b1, c[r][1]);
                        c[r][2] = _mm256_fmadd_ps(xb, b2, c[r][2]);
                    }
                }
            }
            for (int r = 0; r < 4 && r0 + r < mr; r++)
                for (int x = 0; x < 3; x++) _mm256_storeu_ps(acc + (r0 + r) * ldo + h + 8 * x, c[r][x]);
        }
#else
    (void)g, (void)ng, (void)pfb;
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < HF_PNB; c++) {
            float v = init ? init[c] : acc[r * ldo + c];
            for (long i = i0; i < i1; i++)
                for (int s = 0; s < HF_PSTREAMS; s++) {
                    long kk = s * q + i;
                    if (kk >= k) break;
                    v = fmaf(xp[kk * HF_PMR + r], pan[kk * HF_PNB + c], v);
                }
            acc[r * ldo + c] = v;
        }
#endif
}

/* The sums of rows [r0, r1) in acc (HF_PNB floats per row, row r0 first) through the epilogue (act, mul, res) into
 * Y's columns [c0, c0 + nv): the graph's activation, a gated MLP's gate product and a residual add, in that order,
 * each one fp32 op as ATen's. ``up``: a gated product's up sums laid out as acc, the multiplier instead of mul
 * (act(gate) times up: the bits of the up product stored with mul = the gate's result), else NULL. */
static void panel_store(const panel_ctx *a, int sg, const float *acc, long c0, long nv, long r0, long r1,
                        const float *up) {
    long n = a->n[sg];
    for (long r = r0; r < r1; r++) {
        const float *o = acc + (r - r0) * HF_PNB;
        float *y = a->y[sg] + r * n + c0;
        const float *mu = up ? up + (r - r0) * HF_PNB : a->mul ? a->mul + r * n + c0 : 0;
        const float *re = a->res ? a->res + r * n + c0 : 0;
#if defined(__AVX512F__)
        for (long c = 0; c < nv; c += 16) {
            __mmask16 mk = mask16(nv - c);
            __m512 v = act16(_mm512_loadu_ps(o + c), a->act);
            if (mu) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mk, mu + c));
            if (re) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, re + c));
            _mm512_mask_storeu_ps(y + c, mk, v);
        }
#elif defined(HF_ACT8)
        for (long c = 0; c < nv; c += 8)
            act8_store(y + c, o + c, nv - c < 8 ? nv - c : 8, a->act, mu ? mu + c : 0, re ? re + c : 0);
#else
        for (long c = 0; c < nv; c++) {
            float v = act_of(o[c], a->act);
            if (mu) v = v * mu[c];
            if (re) v = v + re[c];
            y[c] = v;
        }
#endif
    }
}

/* Chunk c's span: global panels [*j0, *j1) over rows [*ra, *rb). The team takes chunks dynamically (hf_run_team),
 * so the first ncm chunks are runs of HF_PCHUNK panels over every row, as many as divide evenly among the threads
 * (npm panels: a multiple of threads x HF_PCHUNK), and each panel left over is split into ``slices`` (the thread
 * count) ranges of whole row groups, one chunk apiece, taken last. Why: with chunks of 3 and 4 panels (43 panels of
 * a 2048-wide product in 12 near-equal runs) one thread was left a panel behind in most calls, and the other waited
 * at the region's end: idle for about 5% of the time of llama-110m's gated products at 128 rows (one-off trace of
 * the team's regions, docs/arch/runtime.md). Which rows run together does not change any output's chain of
 * multiply-adds, so the bits do not change. */
static inline void panel_span(const panel_ctx *a, long c, long *j0, long *j1, long *ra, long *rb) {
    if (c < a->ncm) {
        *j0 = c * a->npm / a->ncm, *j1 = (c + 1) * a->npm / a->ncm, *ra = 0, *rb = a->m;
        return;
    }
    long t = c - a->ncm, sl = t % a->slices, groups = (a->m + HF_PMR - 1) / HF_PMR;
    *j0 = a->npm + t / a->slices, *j1 = *j0 + 1;
    *ra = sl * groups / a->slices * HF_PMR, *rb = (sl + 1) * groups / a->slices * HF_PMR;
    if (*rb > a->m) *rb = a->m;
}

/* The k-rows per stream (q): ceil(k / HF_PSTREAMS), raised where needed so that the streams start about a quarter
 * of a 64-set L1 apart: the k-rows of one step of the HF_PSTREAMS streams are q * HF_PNB floats apart, which for q a
 * multiple of 64 (k = 768, 1024, 3072, ...) put all four in the same L1 sets, and a block's reads together with
 * the next block's prefetches then exceeded the sets' ways. With the skew the 4-row passes of the AVX2 path ran
 * a 128-row product from cache at 1.04x the rate (one-off, docs/arch/runtime.md). It decides each output's chain
 * of multiply-adds, so every path takes the same q (bits do not depend on the build). k < 256: no skew (few
 * k-rows, and the raise could empty a stream). */
_Static_assert(HF_PNB * sizeof(float) == 3 * 64, "panel_q: a k-row of a panel is three cache lines");
static inline long panel_q(long k) {
    long q = (k + HF_PSTREAMS - 1) / HF_PSTREAMS;
    if (k < 256) return q;
    for (long set = q * HF_PNB * (long)sizeof(float) / 64 % 64; set < 12 || set > 20; set = (set + 3) % 64) q++;
    return q;
}

/* Chunk c's panels of a gated product (see panel_ctx): per row block, the gate's panel through all k-blocks into
 * gs, then the up product's into us (each sum the chain panel_chunk makes for it), then both through
 * panel_store. Why one call: the gate's result no longer goes to memory and back, and X is packed once.
 * Both chunk functions are flattened (panel_block inlined into each): with two callers GCC kept panel_block out of
 * line, and plain products ran 5-9% slower (measured: docs/arch/runtime.md, session 35). */
__attribute__((flatten)) static void panel_chunk_gated(void *ctx, long c) {
    const panel_ctx *a = ctx;
    long k = a->k, q = panel_q(k), n = a->n[0];
    long j0, j1, ra, rb;
    panel_span(a, c, &j0, &j1, &ra, &rb);
    float gs[HF_PSUP * HF_PNB] __attribute__((aligned(64)));
    float us[HF_PSUP * HF_PNB] __attribute__((aligned(64)));
    for (long j = j0; j < j1; j++) {
        long c0 = j * HF_PNB, nv = n - c0 < HF_PNB ? n - c0 : HF_PNB;
        const float *pans[2] = {a->p[0] + (size_t)j * k * HF_PNB, a->pu + (size_t)j * k * HF_PNB};
        const float *pnext = j + 1 < j1 ? pans[0] + (size_t)k * HF_PNB : NULL; /* the gate's next panel */
        const float *bs[2] = {a->bias[0], a->bu};
        float *outs[2] = {gs, us};
        float binit[2][HF_PNB];
        for (int w = 0; w < 2; w++)
            for (long cc = 0; cc < HF_PNB; cc++) binit[w][cc] = bs[w] && cc < nv ? bs[w][c0 + cc] : 0.f;
        for (long s0 = ra; s0 < rb; s0 += HF_PSUP) {
            long ms = rb - s0 < HF_PSUP ? rb - s0 : HF_PSUP;
            int ng = (int)((ms + HF_PMR - 1) / HF_PMR);
            long kb = ng <= 2 ? HF_PKB_FEW(ng) : HF_PKB; /* see panel_block */
            for (int w = 0; w < 2; w++)
                for (long i0 = 0; i0 == 0 || i0 < q; i0 += kb) {
                    long i1 = i0 + kb < q ? i0 + kb : q;
                    for (long r0 = 0; r0 < ms; r0 += HF_PMR) {
                        int mr = ms - r0 < HF_PMR ? (int)(ms - r0) : HF_PMR;
                        panel_block(a->x + (s0 + r0) * k, k, q, pans[w], i0, i1, mr, outs[w] + r0 * HF_PNB,
                                    HF_PNB, (int)(r0 / HF_PMR), ng, i0 == 0 ? binit[w] : 0, kb,
                                    w == 0 ? pans[1] : s0 + ms >= rb ? pnext : NULL);
                    }
                }
            panel_store(a, 0, gs, c0, nv, s0, s0 + ms, us);
        }
    }
}

/* Chunk c's panels. The sums of up to HF_PSUP rows are kept in one contiguous scratch on the stack (HF_PNB floats a
 * row) while the k-blocks run, and go through the epilogue into Y after a row group's last block: summed in place
 * in Y instead, the row groups' sums sat n floats apart, which for N a multiple of 1024 put every row's sums in the
 * same few L1 sets (evicted to L2 between blocks) and made the last, partial panel need a scratch of its own. */
__attribute__((flatten)) static void panel_chunk(void *ctx, long c) { /* flattened: see panel_chunk_gated */
    const panel_ctx *a = ctx;
    long k = a->k, q = panel_q(k);
    long j0, j1, ra, rb;
    panel_span(a, c, &j0, &j1, &ra, &rb);
    float tmp[HF_PSUP * HF_PNB] __attribute__((aligned(64)));
    int sg = 0;
    for (long j = j0; j < j1; j++) {
        while (j >= a->j0[sg + 1]) sg++; /* the segment (weight) global panel j belongs to */
        long jl = j - a->j0[sg], n = a->n[sg];
        const float *pan = a->p[sg] + (size_t)jl * k * HF_PNB, *bias = a->bias[sg];
        int sn = j + 1 < a->j0[sg + 1] ? sg : sg + 1; /* the next panel's segment */
        const float *pnext = j + 1 < j1 ? a->p[sn] + (size_t)(j + 1 - a->j0[sn]) * k * HF_PNB : NULL;
        long c0 = jl * HF_PNB, nv = n - c0 < HF_PNB ? n - c0 : HF_PNB;
        float binit[HF_PNB];
        for (long cc = 0; cc < HF_PNB; cc++) binit[cc] = bias && cc < nv ? bias[c0 + cc] : 0.f;
        for (long s0 = ra; s0 < rb; s0 += HF_PSUP) {
            long ms = rb - s0 < HF_PSUP ? rb - s0 : HF_PSUP;
            int ng = (int)((ms + HF_PMR - 1) / HF_PMR);
            long kb = ng <= 2 ? HF_PKB_FEW(ng) : HF_PKB; /* see panel_block */
            for (long i0 = 0; i0 == 0 || i0 < q; i0 += kb) { /* once with no steps when k is 0: the bias */
                long i1 = i0 + kb < q ? i0 + kb : q;
                for (long r0 = 0; r0 < ms; r0 += HF_PMR) {
                    int mr = ms - r0 < HF_PMR ? (int)(ms - r0) : HF_PMR;
                    panel_block(a->x + (s0 + r0) * k, k, q, pan, i0, i1, mr, tmp + r0 * HF_PNB, HF_PNB,
                                (int)(r0 / HF_PMR), ng, i0 == 0 ? binit : 0, kb, s0 + ms >= rb ? pnext : NULL);
                    if (i1 == q) /* the group's final sums, still in L1: through the epilogue into Y now */
                        panel_store(a, sg, tmp + r0 * HF_PNB, c0, nv, s0 + r0, s0 + r0 + mr, NULL);
                }
            }
        }
    }
}

/* X [m, k] into groups of HF_PMR rows, each k-row by k-row (xp[(g * k + kk) * HF_PMR + r]), rows past m zero: one
 * group per chunk on torch's OpenMP team, a full group's 8 x 8 blocks transposed in registers. Why: it was packed
 * one element at a time by the calling thread alone while the other threads waited, and its cost grows with m * k
 * where the product's grows with m * k * n / threads, so it weighed most on narrow products (N = 768) with many rows
 * (measured before/after: docs/arch/runtime.md). */
typedef struct {
    const float *x;
    float *xp;
    long m, k;
} pack_x_ctx;

static void panel_pack_group(void *ctx, long g) {
    const pack_x_ctx *a = ctx;
    long m = a->m, k = a->k, kk = 0;
#if defined(__AVX2__) && HF_PMR == 8
    if ((g + 1) * HF_PMR <= m) /* a full group: 8 x 8 blocks transposed in registers (the same values, moved) */
        for (const float *x0 = a->x + g * HF_PMR * k; kk + 8 <= k; kk += 8)
            tr8x8(x0 + kk, k, a->xp + (g * k + kk) * HF_PMR, HF_PMR);
#endif
    for (; kk < k; kk++)
        for (int r = 0; r < HF_PMR; r++) {
            long row = g * HF_PMR + r;
            a->xp[(g * k + kk) * HF_PMR + r] = row < m ? a->x[row * k + kk] : 0.f;
        }
}

_Static_assert(HF_BMR == HF_PMR, "hf_gemm_bf16_panel packs X's pairs with panel_pack_x");
static void panel_pack_x(const float *x, float *xp, long m, long k, int threads) {
    pack_x_ctx a = {x, xp, m, k};
    long groups = (m + HF_PMR - 1) / HF_PMR;
    hf_run_team(panel_pack_group, &a, groups, m * k >= 65536 ? threads : 1);
}

static int panel_run(panel_ctx *a, const float *x, int threads) {
    long m = a->m, k = a->k, groups = (m + HF_PMR - 1) / HF_PMR;
    float *xp = malloc((size_t)groups * HF_PMR * (k > 0 ? k : 1) * sizeof(float));
    if (!xp) return -1;
    threads = clamp_threads(threads);
    panel_pack_x(x, xp, m, k, threads);
    /* the chunks (panel_span): runs of HF_PCHUNK panels that divide evenly, the panels left over in row slices;
     * with one thread, too few panels or too few rows for two slices of HF_PSLICE_ROWS, near-equal runs of about
     * HF_PCHUNK panels as before (a multiple of the thread count) */
    long np = a->j0[a->nseg], unit = (long)threads * HF_PCHUNK, npm = np / unit * unit;
    a->x = xp;
    if (threads > 1 && npm > 0 && npm < np && m >= HF_PSLICE_ROWS * threads) {
        a->npm = npm, a->ncm = npm / HF_PCHUNK, a->slices = threads;
    } else {
        long nc = threads * ((np + unit - 1) / unit);
        a->npm = np, a->ncm = nc < np ? nc : np, a->slices = 1;
    }
    a->nc = a->ncm + (np - a->npm) * a->slices;
    hf_run_team(a->gated ? panel_chunk_gated : panel_chunk, a, a->nc, threads);
    free(xp);
    return 0;
}

/* Y = X W^T + b on panels made by hf_pack_panels (b may be NULL), then the epilogue (panel_store: act, times
 * mul, plus res; act 0 and NULLs for none). X [m, k], Y, mul and res [m, n] dense rows. Returns -1 (nothing done)
 * when its scratch (X's packed rows) cannot be had, -2 for an act the epilogue does not have, else 0. */
int hf_gemm_panel(const float *x, const float *p, const float *bias, float *y, long m, long n, long k, int threads,
                  int act, const float *mul, const float *res) {
    if (!hf_epilogue_act(act)) return -2;
    if (m < 1 || n < 1) return 0;
    panel_ctx a = {0};
    a.m = m, a.k = k, a.nseg = 1, a.p[0] = p, a.bias[0] = bias, a.y[0] = y, a.n[0] = n;
    a.j0[1] = (n + HF_PNB - 1) / HF_PNB, a.act = act, a.mul = mul, a.res = res;
    return panel_run(&a, x, threads);
}

/* Y = act(X Wg^T + bg) * (X Wu^T + bu) (+ res) on the gate's and up product's panels (both [n, k] weights packed by
 * hf_pack_panels; biases and res may be NULL): a gated MLP's gate and up products as one call (panel_chunk_gated),
 * with the bits hf_gemm_panel gives for the gate with ``act`` followed by the up product with ``mul`` = that result.
 * Returns as hf_gemm_panel. */
int hf_gemm_panel_gated(const float *x, const float *pg, const float *pu, const float *bg, const float *bu, float *y,
                        long m, long n, long k, int threads, int act, const float *res) {
    if (!hf_epilogue_act(act)) return -2;
    if (m < 1 || n < 1) return 0;
    panel_ctx a = {0};
    a.m = m, a.k = k, a.nseg = 1, a.p[0] = pg, a.bias[0] = bg, a.y[0] = y, a.n[0] = n;
    a.j0[1] = (n + HF_PNB - 1) / HF_PNB, a.act = act, a.res = res, a.gated = 1, a.pu = pu, a.bu = bu;
    return panel_run(&a, x, threads);
}

/* ``nseg`` (1..HF_PSEG) products of the same X, Y_s = X W_s^T + b_s (b_s may be NULL; no epilogue), as one call:
 * X packed once and the products' panels split between the threads as one list. Each Y_s has the bits
 * hf_gemm_panel gives for it alone (the same chain of multiply-adds per output). Why: a layer's q, k and v
 * projections of one input (separate weights in most models) each packed X and forked the team again, and a
 * narrow product (N = 768 at 128 rows) runs below a wide one. Returns -3 for nseg out of range, else as
 * hf_gemm_panel. */
int hf_gemm_panel_multi(const float *x, int nseg, const float *const *p, const float *const *bias, float *const *y,
                        const long *n, long m, long k, int threads) {
    if (nseg < 1 || nseg > HF_PSEG) return -3;
    if (m < 1) return 0;
    panel_ctx a = {0};
    a.m = m, a.k = k, a.nseg = nseg;
    for (int s = 0; s < nseg; s++) {
        a.p[s] = p[s], a.bias[s] = bias[s], a.y[s] = y[s], a.n[s] = n[s];
        a.j0[s + 1] = a.j0[s] + (n[s] + HF_PNB - 1) / HF_PNB;
    }
    return panel_run(&a, x, threads);
}

/* ---- small elementwise ops and a call list ------------------------------------------------------------------ */

/* y = a + b (op 0) or a * b (op 1) over n fp32 values (or bf16 with ``bf16``: each value widened, the float result
 * rounded to nearest even, as ATen computes a bf16 add or mul). One thread: a decode step's rows are a few KiB.
 * Built with -ffp-contract=off, so each result has the bits of ATen's add / mul. Returns -2 for an unknown op. */
int hf_ewise(const void *a, const void *b, void *y, long n, int op, int bf16) {
    if (op != 0 && op != 1) return -2;
    if (bf16) {
        const hf_bf16 *x = a, *z = b;
        hf_bf16 *o = y;
        for (long i = 0; i < n; i++) o[i] = f2bf(op ? bf2f(x[i]) * bf2f(z[i]) : bf2f(x[i]) + bf2f(z[i]));
        return 0;
    }
    const float *x = a, *z = b;
    float *o = y;
    if (op) for (long i = 0; i < n; i++) o[i] = x[i] * z[i];
    else for (long i = 0; i < n; i++) o[i] = x[i] + z[i];
    return 0;
}

/* memmove of n bytes (a grouped product's row from its scratch into the result's slice). */
void hf_copy(void *dst, const void *src, long n) { memmove(dst, src, (size_t)n); }

/* New K/V rows into the cache buffers at row position pos, all buffers in one call: nb records of 8 words
 * (src, dst, heads, n rows, bytes per row, src head stride, src row stride, dst head stride; strides in bytes,
 * dst rows dense): record b copies src's rows [0, n) of every head to dst's rows [pos, pos + n). Why: a decode step
 * wrote its 2 x layers rows with one ATen copy_ each (a dispatch of a few microseconds per 256-byte row). */
void hf_rows_write(const int64_t *rec, long nb, long pos) {
    for (long b = 0; b < nb; b++) {
        const int64_t *r = rec + 8 * b;
        const char *src = (const char *)(intptr_t)r[0];
        char *dst = (char *)(intptr_t)r[1] + pos * r[4];
        for (long h = 0; h < r[2]; h++)
            for (long i = 0; i < r[3]; i++) memcpy(dst + h * r[7] + i * r[4], src + h * r[5] + i * r[6], (size_t)r[4]);
    }
}

/* The kernels a call list may run: name, whether it returns a status (R: int, nonzero = failure) or nothing (V), its
 * argument kinds (P pointer, L long, I int, F float: the Python side checks them against its own signatures), and
 * the call with each argument read from the record. */
#define HF_CALLS(X) \
    X(hf_gemv_nk, V, "PPPPLLI", (AP(0), AP(1), AP(2), AP(3), AL(4), AL(5), AI(6))) \
    X(hf_gemv_kn, V, "PPPPLLIPI", (AP(0), AP(1), AP(2), AP(3), AL(4), AL(5), AI(6), AP(7), AI(8))) \
    X(hf_gemv_res, V, "PPPPPLLIIPI", (AP(0), AP(1), AP(2), AP(3), AP(4), AL(5), AL(6), AI(7), AI(8), AP(9), AI(10))) \
    X(hf_gemv_nk_multi, R, "IPPPPPLI", (AI(0), AP(1), AP(2), AP(3), AP(4), AP(5), AL(6), AI(7))) \
    X(hf_rms_norm, V, "PPPLLFI", (AP(0), AP(1), AP(2), AL(3), AL(4), AF(5), AI(6))) \
    X(hf_layer_norm, V, "PPPPLLFI", (AP(0), AP(1), AP(2), AP(3), AL(4), AL(5), AF(6), AI(7))) \
    X(hf_rotary, V, "PPPPLLI", (AP(0), AP(1), AP(2), AP(3), AL(4), AL(5), AI(6))) \
    X(hf_decode_attention, V, "PPPPPPPPPLLLLFI", (AP(0), AP(1), AP(2), AP(3), AP(4), AP(5), AP(6), AP(7), AP(8), \
                                                  AL(9), AL(10), AL(11), AL(12), AF(13), AI(14))) \
    X(hf_linear_act, V, "PPPPLLIIIPI", (AP(0), AP(1), AP(2), AP(3), AL(4), AL(5), AI(6), AI(7), AI(8), AP(9), AI(10))) \
    X(hf_gated_mlp, V, "PPPPPPLLII", (AP(0), AP(1), AP(2), AP(3), AP(4), AP(5), AL(6), AL(7), AI(8), AI(9))) \
    X(hf_gated_mlp_res, V, "PPPPPPPLLII", (AP(0), AP(1), AP(2), AP(3), AP(4), AP(5), AP(6), AL(7), AL(8), AI(9), \
                                          AI(10))) \
    X(hf_gemv_q8, V, "PPPPPLLII", (AP(0), AP(1), AP(2), AP(3), AP(4), AL(5), AL(6), AI(7), AI(8))) \
    X(hf_gemv_q8a, R, "PPPPPLLII", (AP(0), AP(1), AP(2), AP(3), AP(4), AL(5), AL(6), AI(7), AI(8))) \
    X(hf_gemm_q8a, R, "PPPPPLLLII", (AP(0), AP(1), AP(2), AP(3), AP(4), AL(5), AL(6), AL(7), AI(8), AI(9))) \
    X(hf_gemv_q4a, R, "PPPPPLLLII", (AP(0), AP(1), AP(2), AP(3), AP(4), AL(5), AL(6), AL(7), AI(8), AI(9))) \
    X(hf_gemm_q4a, R, "PPPPPLLLLII", (AP(0), AP(1), AP(2), AP(3), AP(4), AL(5), AL(6), AL(7), AL(8), AI(9), AI(10))) \
    X(hf_gemm_few, R, "PPPPLLLII", (AP(0), AP(1), AP(2), AP(3), AL(4), AL(5), AL(6), AI(7), AI(8))) \
    X(hf_gemm_few_kn, R, "PPPPLLLIIPI", (AP(0), AP(1), AP(2), AP(3), AL(4), AL(5), AL(6), AI(7), AI(8), AP(9), AI(10))) \
    X(hf_gated_mlp_few, R, "PPPPPPPLLLII", (AP(0), AP(1), AP(2), AP(3), AP(4), AP(5), AP(6), AL(7), AL(8), AL(9), \
                                           AI(10), AI(11))) \
    X(hf_gemv_bf16, V, "PPPPLLIIIPI", (AP(0), AP(1), AP(2), AP(3), AL(4), AL(5), AI(6), AI(7), AI(8), AP(9), AI(10))) \
    X(hf_gemv_bf16_res, V, "PPPPPLLIIIPI", (AP(0), AP(1), AP(2), AP(3), AP(4), AL(5), AL(6), AI(7), AI(8), AI(9), \
                                           AP(10), AI(11))) \
    X(hf_gated_mlp_bf16, V, "PPPPPPLLII", (AP(0), AP(1), AP(2), AP(3), AP(4), AP(5), AL(6), AL(7), AI(8), AI(9))) \
    X(hf_gated_mlp_bf16_res, V, "PPPPPPPLLII", (AP(0), AP(1), AP(2), AP(3), AP(4), AP(5), AP(6), AL(7), AL(8), \
                                               AI(9), AI(10))) \
    X(hf_rms_norm_bf16, V, "PPPLLFI", (AP(0), AP(1), AP(2), AL(3), AL(4), AF(5), AI(6))) \
    X(hf_layer_norm_bf16, V, "PPPPLLFI", (AP(0), AP(1), AP(2), AP(3), AL(4), AL(5), AF(6), AI(7))) \
    X(hf_rotary_bf16, V, "PPPPLLI", (AP(0), AP(1), AP(2), AP(3), AL(4), AL(5), AI(6))) \
    X(hf_decode_attention_bf16, V, "PPPPPPPPPLLLLFI", (AP(0), AP(1), AP(2), AP(3), AP(4), AP(5), AP(6), AP(7), \
                                                       AP(8), AL(9), AL(10), AL(11), AL(12), AF(13), AI(14))) \
    X(hf_ewise, R, "PPPLII", (AP(0), AP(1), AP(2), AL(3), AI(4), AI(5))) \
    X(hf_copy, V, "PPL", (AP(0), AP(1), AL(2)))

#define HF_CALL_ENUM(name, ret, sig, args) HF_OP_##name,
enum { HF_CALLS(HF_CALL_ENUM) HF_NCALLS };
#define HF_CALL_NAME(name, ret, sig, args) #name,
#define HF_CALL_SIG(name, ret, sig, args) sig,
static const char *const hf_call_names[] = {HF_CALLS(HF_CALL_NAME)};
static const char *const hf_call_sigs[] = {HF_CALLS(HF_CALL_SIG)};

/* The call list's table, for the Python side: how many kernels, and kernel ``i``'s name and argument kinds. */
int hf_call_count(void) { return HF_NCALLS; }
const char *hf_call_name(int i) { return i >= 0 && i < HF_NCALLS ? hf_call_names[i] : NULL; }
const char *hf_call_sig(int i) { return i >= 0 && i < HF_NCALLS ? hf_call_sigs[i] : NULL; }

#define HF_NT INT64_MIN /* an int argument that is the thread count given to hf_run_calls */
static inline float hf_arg_f32(int64_t v) {
    uint32_t u = (uint32_t)(uint64_t)v;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Run ``n`` kernel calls in order, as Python would call them one by one (each a whole call of its kernel, with its
 * own threads): ``rec`` holds, per call, its kernel's index in the table above, its argument count and its
 * arguments (pointers and integers as int64, a float's bits in the low 32, HF_NT for the thread count ``threads``).
 * Why: a decode step is ~10 kernel calls per layer whose arguments are all known when the program is built, and each
 * call from Python costs about a microsecond of argument conversion plus the interpreter's statements around it.
 * Returns -1 when every call ran and returned 0; else the index of the first call that returned nonzero (its value in
 * *status; later calls not run), or of a malformed record (*status -100: unknown kernel or wrong argument count). */
int64_t hf_run_calls(const int64_t *rec, int64_t n, int threads, int64_t *status) {
    const int64_t *r = rec;
    *status = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t op = r[0], na = r[1];
        const int64_t *a = r + 2;
        int64_t rc = 0;
        int nt = threads;
#define AP(i) ((void *)(intptr_t)a[i])
#define AL(i) ((long)a[i])
#define AI(i) (a[i] == HF_NT ? nt : (int)a[i])
#define AF(i) hf_arg_f32(a[i])
#define HF_RET_R(call) rc = (int64_t)(call)
#define HF_RET_V(call) (call)
#define HF_CALL_CASE(name, ret, sig, args) \
    case HF_OP_##name: \
        if (na != (int64_t)(sizeof sig - 1)) { *status = -100; return i; } \
        HF_RET_##ret(name args); \
        break;
        switch (op) {
            HF_CALLS(HF_CALL_CASE)
        default:
            *status = -100;
            return i;
        }
#undef AP
#undef AL
#undef AI
#undef AF
        if (rc) {
            *status = rc;
            return i;
        }
        r += 2 + na;
    }
    return -1;
}
