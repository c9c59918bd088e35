/* A machine's clocks stepped and suspended for the chaos soak (issue 48, item 4): an LD_PRELOAD library
   that adds two offsets, read on every call from a 16-byte file ($ANDREA_SOAK_CLOCK_FILE: int64 wall
   offset, int64 monotonic offset, in nanoseconds, native byte order), to the clocks a process reads.

   The wall offset moves CLOCK_REALTIME alone (gettimeofday, time): `date -s` or an NTP step. The
   monotonic offset moves CLOCK_MONOTONIC alone: a suspend, which stops it while CLOCK_BOOTTIME (never
   touched here) and the wall clock run on. Absolute-time waits on a moved clock are moved back to the
   kernel's (clock_nanosleep, sem_clockwait, pthread_cond_clockwait), so a sleep lasts what it asked.
   libfaketime 0.9.10 cannot do either: faking the wall clock alone makes every Python time.sleep fail
   with EINVAL, and it moves the monotonic clock with the wall clock (see bench/README.md). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static volatile int64_t *offsets; /* [0] wall, [1] monotonic; NULL: none */
static int tried;

static void load(void) {
    if (__atomic_load_n(&tried, __ATOMIC_ACQUIRE)) return;
    const char *path = getenv("ANDREA_SOAK_CLOCK_FILE");
    if (path) {
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            void *m = mmap(NULL, 16, PROT_READ, MAP_SHARED, fd, 0);
            close(fd);
            if (m != MAP_FAILED) offsets = m;
        }
    }
    __atomic_store_n(&tried, 1, __ATOMIC_RELEASE);
}

static int64_t offset_of(clockid_t clk) {
    load();
    if (!offsets) return 0;
    switch (clk) {
    case CLOCK_REALTIME: case CLOCK_REALTIME_COARSE:
        return __atomic_load_n(&offsets[0], __ATOMIC_RELAXED);
    case CLOCK_MONOTONIC: case CLOCK_MONOTONIC_COARSE: case CLOCK_MONOTONIC_RAW:
        return __atomic_load_n(&offsets[1], __ATOMIC_RELAXED);
    default:
        return 0;
    }
}

static void shift(struct timespec *ts, int64_t ns) {
    int64_t t = (int64_t)ts->tv_sec * 1000000000 + ts->tv_nsec + ns;
    ts->tv_sec = t / 1000000000;
    ts->tv_nsec = t % 1000000000;
    if (ts->tv_nsec < 0) { ts->tv_nsec += 1000000000; ts->tv_sec -= 1; }
}

int clock_gettime(clockid_t clk, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *);
    if (!real) real = dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(clk, ts);
    if (rc == 0) shift(ts, offset_of(clk));
    return rc;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    struct timespec ts;
    (void)tz;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) return -1;
    if (tv) { tv->tv_sec = ts.tv_sec; tv->tv_usec = ts.tv_nsec / 1000; }
    return 0;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out) *out = ts.tv_sec;
    return ts.tv_sec;
}

int clock_nanosleep(clockid_t clk, int flags, const struct timespec *req, struct timespec *rem) {
    static int (*real)(clockid_t, int, const struct timespec *, struct timespec *);
    if (!real) real = dlsym(RTLD_NEXT, "clock_nanosleep");
    struct timespec at = *req;
    if (flags & TIMER_ABSTIME) shift(&at, -offset_of(clk));
    return real(clk, flags, &at, rem);
}

int sem_clockwait(sem_t *sem, clockid_t clk, const struct timespec *abstime) {
    static int (*real)(sem_t *, clockid_t, const struct timespec *);
    if (!real) real = dlsym(RTLD_NEXT, "sem_clockwait");
    struct timespec at = *abstime;
    shift(&at, -offset_of(clk));
    return real(sem, clk, &at);
}

int pthread_cond_clockwait(pthread_cond_t *c, pthread_mutex_t *m, clockid_t clk, const struct timespec *abstime) {
    static int (*real)(pthread_cond_t *, pthread_mutex_t *, clockid_t, const struct timespec *);
    if (!real) real = dlsym(RTLD_NEXT, "pthread_cond_clockwait");
    struct timespec at = *abstime;
    shift(&at, -offset_of(clk));
    return real(c, m, clk, &at);
}
