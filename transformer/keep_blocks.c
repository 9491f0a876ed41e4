// Keeps large freed blocks for the next allocation of their size: preloaded into train.py's and
// eval.py's process (LD_PRELOAD, set by accelerator.restart_with_malloc_tunables) and switched on by
// accelerator.keep_step_buffers once a CPU step's buffer is known to be too large for mallopt.
//
// Why: glibc maps every block above 32 MiB afresh and unmaps it when freed, and a thread's arena
// cannot hold one above 64 MiB whatever mallopt says, so XLA:CPU's step buffer (474 MB at
// benchmarks/vs_pytorch.py's t128) is faulted in page by page every step and freed in bulk by the
// kernel, now and then in the middle of a step. Parked here instead, the next step gets the same
// pages back (benchmarks/README.md, "Parking the large buffers").
//
// Off (the state it loads in) every call passes straight to glibc. On, a freed block of `smallest`
// bytes or more is parked, oldest evicted first, as long as the parked blocks stay within `budget`
// bytes and SLOTS blocks; an allocation of `smallest` bytes or more takes the smallest parked block
// whose usable size is within a quarter above the request and whose address has its alignment.
// Parked blocks are ordinary glibc blocks: whoever gets one frees or reallocates it as usual.
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

extern void *__libc_malloc(size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);

#define SLOTS 8

static struct {
  void *block;
  size_t size;
} parked[SLOTS];  // oldest first
static int n_parked;
static size_t parked_bytes, budget;
static size_t smallest = SIZE_MAX;  // SIZE_MAX: off
static long hits, misses;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

// Takes parked block i out of the list (the lock held).
static void *unpark(int i) {
  void *block = parked[i].block;
  parked_bytes -= parked[i].size;
  for (; i + 1 < n_parked; i++) parked[i] = parked[i + 1];
  n_parked--;
  return block;
}

static void *take(size_t size, size_t align) {
  if (size < __atomic_load_n(&smallest, __ATOMIC_RELAXED)) return NULL;
  void *found = NULL;
  pthread_mutex_lock(&lock);
  int best = -1;
  for (int i = 0; i < n_parked; i++) {
    size_t have = parked[i].size;
    if (have >= size && have - size <= size / 4 && (uintptr_t)parked[i].block % align == 0 &&
        (best < 0 || have < parked[best].size))
      best = i;
  }
  if (best >= 0) {
    found = unpark(best);
    hits++;
  } else {
    misses++;
  }
  pthread_mutex_unlock(&lock);
  return found;
}

// Parks `block` (1), or leaves it to the caller to free (0). Evicted blocks are freed outside the
// lock: unmapping hundreds of megabytes takes the kernel a while.
static int park(void *block) {
  size_t size = malloc_usable_size(block);
  if (size < __atomic_load_n(&smallest, __ATOMIC_RELAXED)) return 0;
  void *evicted[SLOTS];
  int n_evicted = 0, done = 0;
  pthread_mutex_lock(&lock);
  if (size <= budget) {
    while (n_parked == SLOTS || parked_bytes + size > budget) evicted[n_evicted++] = unpark(0);
    parked[n_parked].block = block;
    parked[n_parked].size = size;
    n_parked++;
    parked_bytes += size;
    done = 1;
  }
  pthread_mutex_unlock(&lock);
  for (int i = 0; i < n_evicted; i++) __libc_free(evicted[i]);
  return done;
}

// Switches parking on for blocks of `from` bytes or more, up to `most` bytes parked (0: off, and
// every parked block freed).
void transformer_keep_blocks(size_t from, size_t most) {
  void *evicted[SLOTS];
  int n_evicted = 0;
  pthread_mutex_lock(&lock);
  budget = most;
  __atomic_store_n(&smallest, most ? from : SIZE_MAX, __ATOMIC_RELAXED);
  while (n_parked && (!most || parked_bytes > budget)) evicted[n_evicted++] = unpark(0);
  pthread_mutex_unlock(&lock);
  for (int i = 0; i < n_evicted; i++) __libc_free(evicted[i]);
}

// hits, misses (allocations of `from` bytes or more served from a parked block, or not), blocks
// parked, bytes parked
void transformer_keep_blocks_stats(long out[4]) {
  pthread_mutex_lock(&lock);
  out[0] = hits;
  out[1] = misses;
  out[2] = n_parked;
  out[3] = (long)parked_bytes;
  pthread_mutex_unlock(&lock);
}

void *malloc(size_t size) {
  void *block = take(size, 16);
  return block ? block : __libc_malloc(size);
}

void *memalign(size_t align, size_t size) {
  void *block = take(size, align ? align : 1);
  return block ? block : __libc_memalign(align, size);
}

void *aligned_alloc(size_t align, size_t size) { return memalign(align, size); }

int posix_memalign(void **out, size_t align, size_t size) {
  if (align == 0 || align % sizeof(void *) != 0 || (align & (align - 1)) != 0) return EINVAL;
  void *block = memalign(align, size);
  if (block == NULL) return ENOMEM;
  *out = block;
  return 0;
}

void free(void *block) {
  if (block != NULL && __atomic_load_n(&smallest, __ATOMIC_RELAXED) != SIZE_MAX && park(block)) return;
  __libc_free(block);
}
