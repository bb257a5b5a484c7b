/* LD_PRELOAD shim for benchmarks/step_regions.py: counts libgomp parallel regions (GOMP_parallel, the
   entry of torch's at::parallel_for and of oneDNN's GEMMs) and the wall time inside them. Only
   outermost regions count (a team of threads, a join to wait on); a region opened inside another runs
   on one thread with no join and is counted apart (omp_count_nested). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <time.h>
static unsigned long long regions, region_ns, nested;
static int (*level)(void);
static void (*real)(void (*)(void *), void *, unsigned, unsigned);
unsigned long long omp_count_regions(void) { return regions; }
unsigned long long omp_count_ns(void) { return region_ns; }
unsigned long long omp_count_nested(void) { return nested; }
void GOMP_parallel(void (*fn)(void *), void *data, unsigned n, unsigned flags) {
  if (!real) real = dlsym(RTLD_NEXT, "GOMP_parallel");
  if (!level) level = dlsym(RTLD_DEFAULT, "omp_get_level");
  if (level()) { /* inside another region, on any of its threads */
    __atomic_add_fetch(&nested, 1, __ATOMIC_RELAXED);
    real(fn, data, n, flags);
    return;
  }
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  real(fn, data, n, flags);
  clock_gettime(CLOCK_MONOTONIC, &b);
  __atomic_add_fetch(&regions, 1, __ATOMIC_RELAXED);
  __atomic_add_fetch(&region_ns, (b.tv_sec - a.tv_sec) * 1000000000ull + (b.tv_nsec - a.tv_nsec),
                     __ATOMIC_RELAXED);
}
