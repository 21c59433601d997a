{{/*
ambientd.values: the chart's values as Istio's cni chart computes them, in
order of precedence (last wins): the defaults (values.yaml,
_internal_defaults_do_not_set), the profile, the global.platform preset, the
user's values; then everything under `cni:` is copied to the top level (so a
preset's `cni.cniBinDir` wins, as in Istio's chart). Returned as YAML: every
template reads `include "ambientd.values" . | fromYaml`.
*/}}
{{- define "ambientd.values" -}}
{{- $user := deepCopy .Values }}
{{- if $user.defaults }}
{{- fail "values: remove the `defaults.` prefix (for example --set hub=foo, not --set defaults.hub=foo)" }}
{{- end }}
{{- $v := deepCopy $user._internal_defaults_do_not_set }}
{{- $_ := unset $user "_internal_defaults_do_not_set" }}
{{- $profile := dict }}
{{- with coalesce $user.profile ($user.global).profile }}
{{- if ne . "ambient" }}
{{- fail (printf "values: profile %q: ambientd is the ambient node agent; the only profile it takes is ambient" .) }}
{{- end }}
{{- $profile = dict "cni" (dict "ambient" (dict "enabled" true)) }}
{{- end }}
{{- with coalesce $user.platform ($user.global).platform }}
{{- $presets := dict
    "gke" (dict "cni" (dict "cniBinDir" "" "resourceQuotas" (dict "enabled" true)) "resourceQuotas" (dict "enabled" true))
    "k3d" (dict "cni" (dict "cniConfDir" "/var/lib/rancher/k3s/agent/etc/cni/net.d" "cniBinDir" "/bin"))
    "k3s" (dict "cni" (dict "cniConfDir" "/var/lib/rancher/k3s/agent/etc/cni/net.d" "cniBinDir" "/var/lib/rancher/k3s/data/cni"))
    "microk8s" (dict "cni" (dict "cniConfDir" "/var/snap/microk8s/current/args/cni-network" "cniBinDir" "/var/snap/microk8s/current/opt/cni/bin"))
    "minikube" (dict "cni" (dict "cniNetnsDir" "/var/run/docker/netns"))
    "openshift" (dict "cni" (dict "cniBinDir" "/var/lib/cni/bin" "cniConfDir" "/etc/kubernetes/cni/net.d") "seLinuxOptions" (dict "type" "spc_t"))
}}
{{- if not (hasKey $presets .) }}
{{- fail (printf "values: unknown global.platform %q (known: %s)" . (keys $presets | sortAlpha | join ", ")) }}
{{- end }}
{{- $_ := mustMergeOverwrite $profile (get $presets .) }}
{{- end }}
{{- $_ := mustMergeOverwrite $v $profile $user }}
{{- with $v.cni }}
{{- $_ := mustMergeOverwrite $v . }}
{{- end }}
{{- $_ := unset $v "cni" }}
{{- toYaml $v }}
{{- end }}

{{/* ambientd.inScope: "true" if objects of scope (cluster or namespace) are rendered (global.resourceScope). */}}
{{- define "ambientd.inScope" -}}
{{- $s := .v.global.resourceScope | default "all" }}
{{- if or (eq $s "all") (eq $s .scope) }}true{{ end }}
{{- end }}

{{/* ambientd.logLevel: Istio's logging.level (plain or scoped) as one of ambientd's levels. */}}
{{- define "ambientd.logLevel" -}}
{{- $raw := coalesce .logging.level .global.logging.level "info" }}
{{- $rank := dict "none" 0 "fatal" 0 "error" 0 "warn" 1 "warning" 1 "info" 2 "debug" 3 }}
{{- $names := list "error" "warn" "info" "debug" }}
{{- $default := -1 }}
{{- $most := -1 }}
{{- range splitList "," $raw }}
{{- $kv := splitList ":" (trim .) }}
{{- $lvl := last $kv | lower }}
{{- if not (hasKey $rank $lvl) }}
{{- fail (printf "values: logging.level %q: unknown level %q (none, error, warn, info, debug)" $raw $lvl) }}
{{- end }}
{{- $r := get $rank $lvl | int }}
{{- if or (eq (len $kv) 1) (eq (first $kv) "default") }}{{ $default = $r }}{{ end }}
{{- if gt $r $most }}{{ $most = $r }}{{ end }}
{{- end }}
{{- index $names (ternary $default $most (ge $default 0)) }}
{{- end }}

{{/* ambientd.repairMode: Istio's repair.* as --repair-mode (repairPods, else deletePods, else labelPods). */}}
{{- define "ambientd.repairMode" -}}
{{- if not .enabled }}off
{{- else if .repairPods }}repair
{{- else if .deletePods }}delete
{{- else if .labelPods }}label
{{- else }}off
{{- end }}
{{- end }}

{{/* ambientd.resources: Istio's resource rendering: resources, else global.defaultResources; empty values left out. */}}
{{- define "ambientd.resources" -}}
{{- $res := .resources | default .global.defaultResources }}
{{- $out := dict }}
{{- range $key := list "limits" "requests" }}
{{- $m := dict }}
{{- range $name, $value := (get $res $key | default dict) }}
{{- if $value }}{{ $_ := set $m $name $value }}{{ end }}
{{- end }}
{{- if $m }}{{ $_ := set $out $key $m }}{{ end }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{/*
ambientd.metricsPort: the port the agent serves /metrics on: the one of
AMBIENTD_METRICS_ADDR in the container's env (which wins over the
ConfigMap), else in ambientd.config (the ConfigMap's last entry), else
:15014. The container port, the scrape annotation and the PodMonitor
follow it.
*/}}
{{- define "ambientd.metricsPort" -}}
{{- $addr := coalesce (.env | default dict).AMBIENTD_METRICS_ADDR (.ambientd.config | default dict).AMBIENTD_METRICS_ADDR ":15014" | toString }}
{{- $port := regexFind "[0-9]+$" $addr }}
{{- if or (not $port) (not (regexMatch "^[^:]*:[0-9]+$|^\\[[0-9a-fA-F:.]*\\]:[0-9]+$" $addr)) }}
{{- fail (printf "values: AMBIENTD_METRICS_ADDR %q: want host:port or :port" $addr) }}
{{- end }}
{{- $port }}
{{- end }}

{{/*
ambientd.gateMechanism: how the readiness gate is added at admission
(docs/readiness.md): readinessGate.mechanism, where auto is the
MutatingAdmissionPolicy from Kubernetes 1.36 (admissionregistration.k8s.io/v1
there) and the webhook (ambientd webhook) before.
*/}}
{{- define "ambientd.gateMechanism" -}}
{{- $m := .v.ambientd.readinessGate.mechanism }}
{{- if eq $m "auto" }}
{{- ternary "policy" "webhook" (semverCompare ">=1.36.0-0" .caps.KubeVersion.Version) }}
{{- else }}
{{- $m }}
{{- end }}
{{- end }}
