/* A persistent thread pool for the C kernels (prepended to nvfp4_cpu.c and recipe_cpu.c when they are built:
 * kernels/src/nvfp4_cpu.py, open_library).
 *
 * Why: the kernels used to be split across a Python ThreadPoolExecutor, one ctypes call a thread; its
 * submit / future / GIL hand-offs cost tens of microseconds a call against kernels whose memory floor on 16 CPUs
 * is 0.2-2.6 ms. Here one ctypes call runs a whole kernel: the caller queues a job of tasks (row ranges), wakes
 * up to `threads - 1` sleeping workers and works on the same job itself, then waits for the last task.
 * Not OpenMP: a second OpenMP runtime next to torch's spins against it.
 *
 * - Workers are created on demand, as many as the jobs in flight ask for together but never more than the
 *   largest job asks for alone (its caller's threads - 1): pipeline streams call at once, each told the worker's
 *   CPUs, and share those workers (4 streams x 15 workers each ran 60 kernel threads on 16 CPUs, polling, beside
 *   the hashing: pack's CPU seconds 34 -> 41 on the H200 machine, block FP8 in the pipeline 0.7 -> 14.9 s/GB). Between jobs a worker polls the queue for kc_spin_ns, then sleeps on a
 *   condition variable: waking 15 sleeping threads one by one took 53 us a call on the H200 machine's CPUs
 *   (against 1.2 us for one thread), a fifth of the cast's floor; back-to-back calls now find them awake. The
 *   caller polls for its job's end the same way before it sleeps.
 * - Tasks are claimed one at a time from the job, so a descheduled thread delays only its task; which thread
 *   runs a task never changes a byte (tasks write disjoint outputs, partial results are integers or maxima).
 * - The caller claims tasks of its own job too, so a job finishes even when every worker is busy elsewhere.
 * - Workers block every signal (SIGINT reaches Python's thread), are detached and never joined: at exit they
 *   sleep and the process ends around them. A forked child starts with an empty pool (pthread_atfork), so it
 *   never waits for a parent's threads, which do not exist in it.
 */
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <time.h>
#ifdef __linux__
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KC_PAUSE() _mm_pause()
#else
#define KC_PAUSE() ((void)0)
#endif

typedef void (*kc_task_fn)(void *ctx, int64_t task);

typedef struct kc_job {
    kc_task_fn fn;
    void *ctx;
    int64_t ntasks, next, done;
    int helpers, active; /* workers it may have (threads - 1), workers on it now */
    struct kc_job *queued; /* the next job in the queue */
} kc_job;

#define KC_MAX_WORKERS 1024

static struct {
    pthread_mutex_t mu;
    pthread_cond_t work, finished;
    kc_job *head, *tail;
    int workers, demand, sleeping, cap; /* cap: the most helpers one job has asked for */
} kc_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0};

/* How long an idle worker (or a waiting caller) polls before it sleeps (kc_pool_set_spin). */
static int64_t kc_spin_ns = 100000;

/* Poll `ns` from now on (0: sleep at once): polling workers keep CPUs busy that a file's sha256 chain could have. */
void kc_pool_set_spin(int64_t ns) { __atomic_store_n(&kc_spin_ns, ns < 0 ? 0 : ns, __ATOMIC_RELAXED); }

static inline int64_t kc_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Unlocked: poll until *flag (read atomically) is non-zero or kc_spin_ns pass; returns whether it became so. */
static int kc_spin_until(void *const *ptr, const int64_t *count, int64_t target) {
    const int64_t end = kc_now_ns() + __atomic_load_n(&kc_spin_ns, __ATOMIC_RELAXED);
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if (ptr ? __atomic_load_n(ptr, __ATOMIC_ACQUIRE) != 0 : __atomic_load_n(count, __ATOMIC_ACQUIRE) >= target)
                return 1;
            KC_PAUSE();
        }
        if (kc_now_ns() > end) return 0;
    }
}

static pthread_once_t kc_pool_once = PTHREAD_ONCE_INIT;

static void kc_pool_prepare(void) { pthread_mutex_lock(&kc_pool.mu); }
static void kc_pool_parent(void) { pthread_mutex_unlock(&kc_pool.mu); }
static void kc_pool_child(void) { /* the child has one thread: no worker, no job of another thread */
    pthread_mutex_init(&kc_pool.mu, 0);
    pthread_cond_init(&kc_pool.work, 0);
    pthread_cond_init(&kc_pool.finished, 0);
    kc_pool.head = kc_pool.tail = 0;
    kc_pool.workers = kc_pool.demand = kc_pool.sleeping = kc_pool.cap = 0;
}
static void kc_pool_init(void) { pthread_atfork(kc_pool_prepare, kc_pool_parent, kc_pool_child); }

/* Under the lock: take `j` out of the queue (it is fully claimed). */
static void kc_unqueue(kc_job *j) {
    kc_job **p = &kc_pool.head, *prev = 0;
    while (*p && *p != j) {
        prev = *p;
        p = &(*p)->queued;
    }
    if (!*p) return;
    *p = j->queued;
    if (kc_pool.tail == j) kc_pool.tail = prev;
}

/* Under the lock: the next task of `j` (or -1), unqueuing `j` once its last task is claimed. */
static int64_t kc_claim(kc_job *j) {
    if (j->next >= j->ntasks) return -1;
    int64_t t = j->next++;
    if (j->next == j->ntasks) kc_unqueue(j);
    return t;
}

/* Under the lock: run task t of j unlocked, count it done (`worker`: a worker's, which leaves j). Once the last
 * task is counted the caller may return and j is gone: nothing touches j after that. */
static void kc_run_task(kc_job *j, int64_t t, int worker) {
    pthread_mutex_unlock(&kc_pool.mu);
    j->fn(j->ctx, t);
    pthread_mutex_lock(&kc_pool.mu);
    j->active -= worker;
    if (__atomic_add_fetch(&j->done, 1, __ATOMIC_RELEASE) == j->ntasks) pthread_cond_broadcast(&kc_pool.finished);
}

/* Under the lock: the oldest queued job with fewer workers on it than its caller's threads allow. */
static kc_job *kc_pick(void) {
    for (kc_job *j = kc_pool.head; j; j = j->queued)
        if (j->active < j->helpers) return j;
    return 0;
}

/* The nice value workers run at (kc_pool_set_nice). */
static int kc_worker_nice = 0;

/* Workers run at nice `n` (absolute; Linux: a thread's own nice value; elsewhere nothing) from their start or their
 * next job, so that where the CPUs are all busy, the process's other threads (a file's one sha256 chain, the reader)
 * run first. 0: a worker keeps the value it inherited from the thread that made it. */
void kc_pool_set_nice(int32_t n) {
    pthread_mutex_lock(&kc_pool.mu);
    kc_worker_nice = n;
    pthread_mutex_unlock(&kc_pool.mu);
}

static void kc_take_nice(int *mine) {
    if (*mine == kc_worker_nice) return;
    *mine = kc_worker_nice;
#ifdef __linux__
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), *mine); /* raising it back needs privilege: may fail */
#endif
}

static void *kc_worker(void *arg) {
    (void)arg;
    int nice_now = 0;
    pthread_mutex_lock(&kc_pool.mu);
    kc_take_nice(&nice_now); /* a worker made after the value was set runs at it from its start */
    for (;;) {
        kc_job *j;
        int polled = 0;
        while (!(j = kc_pick())) {
            if (!polled) { /* once an idle spell: a job queued while polling is picked at once */
                polled = 1;
                pthread_mutex_unlock(&kc_pool.mu);
                kc_spin_until((void *const *)&kc_pool.head, 0, 0);
                pthread_mutex_lock(&kc_pool.mu);
                continue;
            }
            kc_pool.sleeping++;
            pthread_cond_wait(&kc_pool.work, &kc_pool.mu);
            kc_pool.sleeping--;
        }
        kc_take_nice(&nice_now);
        j->active++;
        kc_run_task(j, kc_claim(j), 1);
    }
    return 0;
}

/* Under the lock: at least `want` workers (fewer if a thread cannot be created: the callers then do more of the
 * work themselves). */
static void kc_grow(int want) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* a new thread inherits this mask */
    while (kc_pool.workers < want && kc_pool.workers < KC_MAX_WORKERS) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int err = pthread_create(&t, &attr, kc_worker, 0);
        pthread_attr_destroy(&attr);
        if (err) break;
        kc_pool.workers++;
    }
    pthread_sigmask(SIG_SETMASK, &old, 0);
}

/* Runs fn(ctx, 0 .. ntasks-1) on the caller and up to threads - 1 workers; returns when all are done. */
static void kc_parallel(kc_task_fn fn, void *ctx, int64_t ntasks, int threads) {
    if (ntasks <= 0) return;
    int64_t helpers64 = ntasks - 1 < (int64_t)threads - 1 ? ntasks - 1 : (int64_t)threads - 1;
    int helpers = helpers64 > 0 ? (int)helpers64 : 0;
    if (!helpers) {
        for (int64_t t = 0; t < ntasks; t++) fn(ctx, t);
        return;
    }
    pthread_once(&kc_pool_once, kc_pool_init);
    kc_job j = {fn, ctx, ntasks, 0, 0, helpers, 0, 0};
    pthread_mutex_lock(&kc_pool.mu);
    kc_pool.demand += helpers;
    if (helpers > kc_pool.cap) kc_pool.cap = helpers;
    int want = kc_pool.demand < kc_pool.cap ? kc_pool.demand : kc_pool.cap;
    if (kc_pool.workers < want) kc_grow(want);
    if (kc_pool.tail) kc_pool.tail->queued = &j; else kc_pool.head = &j;
    kc_pool.tail = &j;
    for (int i = 0; i < helpers && i < kc_pool.sleeping; i++) pthread_cond_signal(&kc_pool.work);
    for (int64_t t; (t = kc_claim(&j)) >= 0;) kc_run_task(&j, t, 0);
    if (j.done < j.ntasks) {
        pthread_mutex_unlock(&kc_pool.mu);
        kc_spin_until(0, &j.done, j.ntasks);
        pthread_mutex_lock(&kc_pool.mu);
    }
    while (j.done < j.ntasks) pthread_cond_wait(&kc_pool.finished, &kc_pool.mu);
    kc_pool.demand -= helpers;
    pthread_mutex_unlock(&kc_pool.mu);
}

#define KC_MIN_SPLIT (1 << 16) /* elements below which one thread does the whole tensor */

/* [*a, *b): the units of task t of ntasks, in order, as even as integers allow. */
static inline void kc_range(int64_t units, int64_t ntasks, int64_t t, int64_t *a, int64_t *b) {
    *a = units * t / ntasks;
    *b = units * (t + 1) / ntasks;
}

/* Tasks for `units` independent units of `unit_work` elements each: one below `min_split` elements in all, else
 * about 4 a thread (dynamic claiming evens out a descheduled or slower thread), at most one a unit. */
static int64_t kc_tasks(int64_t units, int64_t unit_work, int threads, int64_t min_split) {
    if (units <= 0) return 0;
    if (threads <= 1 || units * unit_work < min_split) return 1;
    int64_t t = 4 * (int64_t)threads;
    return t < units ? t : units;
}

/* Workers this process has (tests: a forked child starts with none). */
int32_t kc_pool_workers(void) {
    pthread_mutex_lock(&kc_pool.mu);
    int32_t n = kc_pool.workers;
    pthread_mutex_unlock(&kc_pool.mu);
    return n;
}

/* A benchmark's no-op: the dispatch cost alone. */
static void kc_nop_task(void *ctx, int64_t t) { (void)ctx; (void)t; }
void kc_pool_nop(int64_t ntasks, int32_t threads) { kc_parallel(kc_nop_task, 0, ntasks, threads); }
