#!/usr/bin/env bash
# Every program says which BLAS and which kernels it runs, and warns, with the fix, when they do not match the CPU
# (an OPENBLAS_CORETYPE that is set is kept: some machines set it on purpose).
source "$(dirname "$0")/common.sh"
EVAL=${CROSSKV_EVAL:?}
"$FIT" --version > v.log
expect_in "BLAS OpenBLAS" v.log
expect_in "; kernels " v.log
if grep -qw avx2 /proc/cpuinfo; then
  OPENBLAS_CORETYPE=Prescott "$FIT" --version > p.log
  expect_in "kernels Prescott" p.log
  expect_in "(OPENBLAS_CORETYPE as set)" p.log
  expect_in "warning: SSE3 kernels (Prescott) on an" p.log
  expect_in "set OPENBLAS_CORETYPE=" p.log
fi
"$SYNTH" --out data --shards 2 --sequences 2 --seq-len 64 --with-queries > /dev/null
printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1]}\noutput: {dir: out}\n' > f.yaml
run f.yaml || { cat run.log run.err; die "fit failed"; }
expect_in "BLAS OpenBLAS" run.log
"$EVAL" --mapper out/k1 --source data/source/web/shard-001.h5 --target data/target/web/shard-001.h5 --json e.json \
  > e.log 2>&1 || { cat e.log; die "eval failed"; }
expect_in "BLAS OpenBLAS" e.log
echo "blas_kernels: ok"
