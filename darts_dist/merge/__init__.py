"""The merge stage: mergekit's methods through mergekit as a library (`mergekit`), RegMean from each expert's
inputs on its calibration rows (`regmean`), and the one place that picks between them (`stage`)."""
