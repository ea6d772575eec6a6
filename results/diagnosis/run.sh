#!/bin/bash
# usage: results/diagnosis/run.sh NAME [extra flags...]   (from the repo root)
# Runs the base GRPO outcome-only command plus the extra flags into results/diagnosis/NAME
# and writes the exact command to results/diagnosis/NAME/command.txt.
name=$1; shift
out=results/diagnosis/$name
cmd="python rspo.py --env alfworld --algo grpo --method outcome --num-groups 8 --group-size 8 --max-steps 30 --updates 24 --eval-every 6 --eval-episodes 128 --eval-split valid_seen --seed 0 --threads 1 --no-save-model --no-progress --output-dir $out $*"
mkdir -p $out
echo "$cmd" > $out/command.txt
start=$(date +%s)
$cmd > $out/log.txt 2>&1
rc=$?
echo "rc=$rc wall_s=$(( $(date +%s) - start ))" >> $out/log.txt
