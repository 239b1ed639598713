/*
 * Reference persistent DP of rotor (Beaumont et al., RR-9302; Shilova's thesis ch. 2), written
 * from the pseudo-code of shared/design/rotor.md section 3.2.1 ("Exactly what the reference code
 * computes"): rotor's C `persistent_compute_table` and `persistent_rec`, with its index
 * conventions (code stage i = paper stage i+1), its F_all test (the base-case threshold, and
 * m_null applied to both branches), its summation order ((sum fw) + opt1) + opt2, its
 * tie-breaking (leaf wins ties, smallest j among leaves) and its table layout opt[m][i][l]
 * with m outermost.
 *
 * Used only by benchmarks/bench_checkpoint_dp.py to time optmem's numpy DP against it and to
 * check that both give bit-identical values and the same plans. Not part of the package.
 *
 * Build: gcc -O2 -o rotor_dp rotor_dp.c -lm
 * Input (stdin, whitespace separated):
 *   L mmax budget
 *   fw[0..L]      (fw[L] = 0)
 *   bw[0..L]      (bw[L] = loss time)
 *   x[0..L+1]     (x[0] = input, x[L+1] = 0)
 *   xbar[0..L+1]  (xbar[0] unused, xbar[L+1] = 0)
 *   ftmp[0..L]    (ftmp[L] = 0)
 *   btmp[0..L]    (btmp[L] = loss overhead)
 * Output (stdout):
 *   line 1: seconds spent filling the table
 *   line 2: opt[m][0][L] for m = 0..mmax, as C99 hex floats (exact)
 *   line 3: the sequence for `budget` in rotor notation (Fe_i CF_i Fn_i L B_i), or "inf"
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long L, mmax;
static double *fw, *bw;
static long *x, *xbar, *ftmp, *btmp;
static double *opt;
static long *what;

#define OPT(m, i, l) opt[((m) * (L + 1) + (i)) * (L + 1) + (l)]
#define WHAT(m, i, l) what[((m) * (L + 1) + (i)) * (L + 1) + (l)]

static long lmax(long a, long b) { return a > b ? a : b; }

static void compute_table(void) {
  for (long m = 0; m <= mmax; ++m)
    for (long i = 0; i <= L; ++i)
      if (m >= x[i + 1] + xbar[i + 1] + ftmp[i] && m >= x[i] + x[i + 1] + xbar[i + 1] + btmp[i])
        OPT(m, i, i) = fw[i] + bw[i];
      else
        OPT(m, i, i) = INFINITY;

  for (long m = 0; m <= mmax; ++m)
    for (long d = 1; d <= L; ++d)
      for (long i = 0; i + d <= L; ++i) {
        long idx = i + d;
        long mmin = x[idx + 1] + x[i + 1] + ftmp[i];
        if (idx > i + 1) {
          long max_fwd = 0;
          for (long j = i + 1; j < idx; ++j) max_fwd = lmax(max_fwd, x[j] + x[j + 1] + ftmp[j]);
          mmin = lmax(mmin, x[idx + 1] + max_fwd);
        }
        if (m >= mmin) {
          long best_leaf = -1;
          double sum_fw = 0, best_leaf_cost = INFINITY;
          for (long j = i + 1; j <= idx; ++j) {
            sum_fw += fw[j - 1];
            if (m >= x[j]) {
              double cost = sum_fw + OPT(m - x[j], j, idx) + OPT(m, i, j - 1);
              if (cost < best_leaf_cost) {
                best_leaf_cost = cost;
                best_leaf = j;
              }
            }
          }
          double chain_cost = INFINITY;
          if (m >= xbar[i + 1]) chain_cost = OPT(m, i, i) + OPT(m - xbar[i + 1], i + 1, idx);
          if (best_leaf_cost <= chain_cost) {
            OPT(m, i, idx) = best_leaf_cost;
            WHAT(m, i, idx) = best_leaf;
          } else {
            OPT(m, i, idx) = chain_cost;
            WHAT(m, i, idx) = -1;
          }
        } else {
          OPT(m, i, idx) = INFINITY;
          WHAT(m, i, idx) = 0;
        }
      }
}

static void rec(long i, long l, long m) {
  if (i == l) {
    if (i == L)
      printf(" L");
    else
      printf(" Fe_%ld B_%ld", i, i);
    return;
  }
  long w = WHAT(m, i, l);
  if (w < 0) {
    printf(" Fe_%ld", i);
    rec(i + 1, l, m - xbar[i + 1]);
    printf(" B_%ld", i);
  } else {
    printf(" CF_%ld", i);
    for (long k = i + 1; k < w; ++k) printf(" Fn_%ld", k);
    rec(w, l, m - x[w]);
    rec(i, w - 1, m);
  }
}

static double *read_doubles(long n) {
  double *out = malloc(n * sizeof(double));
  for (long k = 0; k < n; ++k)
    if (scanf("%lf", &out[k]) != 1) exit(2);
  return out;
}

static long *read_longs(long n) {
  long *out = malloc(n * sizeof(long));
  for (long k = 0; k < n; ++k)
    if (scanf("%ld", &out[k]) != 1) exit(2);
  return out;
}

int main(void) {
  long budget;
  if (scanf("%ld %ld %ld", &L, &mmax, &budget) != 3) return 2;
  fw = read_doubles(L + 1);
  bw = read_doubles(L + 1);
  x = read_longs(L + 2);
  xbar = read_longs(L + 2);
  ftmp = read_longs(L + 1);
  btmp = read_longs(L + 1);
  size_t cells = (size_t)(mmax + 1) * (L + 1) * (L + 1);
  opt = calloc(cells, sizeof(double));
  what = calloc(cells, sizeof(long));
  if (!opt || !what) return 3;

  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  compute_table();
  clock_gettime(CLOCK_MONOTONIC, &t1);
  printf("%.6f\n", (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec));

  for (long m = 0; m <= mmax; ++m) printf(m ? " %a" : "%a", OPT(m, 0, L));
  printf("\n");
  if (budget < 0 || budget > mmax || !isfinite(OPT(budget, 0, L)))
    printf("inf");
  else
    rec(0, L, budget);
  printf("\n");
  return 0;
}
