{{/*
Helpers of the kvstore chart: one helper per derived value.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "kvstore.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-<chart> (or just the release when it already holds the chart name), 63 chars. */}}
{{- define "kvstore.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* chart-version, as the helm.sh/chart label wants it. */}}
{{- define "kvstore.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The labels that select the daemon pods; they never change across upgrades. */}}
{{- define "kvstore.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvstore.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: daemon
{{- end -}}

{{/* Standard labels of every resource (component is set per resource). */}}
{{- define "kvstore.labels" -}}
helm.sh/chart: {{ include "kvstore.chart" . }}
app.kubernetes.io/name: {{ include "kvstore.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvstore
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The ServiceAccount the daemon runs as. */}}
{{- define "kvstore.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvstore.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* registry/repository:tag (tag defaults to <appVersion>-<variant>), or @digest. */}}
{{- define "kvstore.image" -}}
{{- $img := .Values.image -}}
{{- $ref := printf "%s/%s" $img.registry $img.repository | trimPrefix "/" -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $ref $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $ref (default (printf "%s-%s" .Chart.AppVersion $img.variant) $img.tag) -}}
{{- end -}}
{{- end -}}

{{/* The bundled Redis image. */}}
{{- define "kvstore.redis.image" -}}
{{- $img := .Values.redis.image -}}
{{- printf "%s/%s:%s" $img.registry $img.repository $img.tag | trimPrefix "/" -}}
{{- end -}}

{{/* Name of the bundled Redis StatefulSet and Service. */}}
{{- define "kvstore.redis.fullname" -}}
{{- printf "%s-redis" (include "kvstore.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Bytes in a Kubernetes quantity (`64Gi`, `512Mi`, `10G`, `4096`); "" when not one of those. */}}
{{- define "kvstore.bytes" -}}
{{- $q := toString . -}}
{{- $num := regexFind "^[0-9]+" $q -}}
{{- $unit := trimPrefix $num $q -}}
{{- $factors := dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 -}}
{{- if and $num (hasKey $factors $unit) -}}
{{- mul (int64 $num) (get $factors $unit) -}}
{{- end -}}
{{- end -}}

{{/* A values size (`64Gi`, `512Mi`, `4096`) as the daemon writes it (`64GiB`, `512MiB`, `4096`). */}}
{{- define "kvstore.daemonSize" -}}
{{- $q := toString . -}}
{{- if hasSuffix "i" $q }}{{ printf "%sB" $q }}{{ else }}{{ $q }}{{ end -}}
{{- end -}}

{{/* Bytes as whole MiB, rounded up, as a quantity (`8448Mi`). */}}
{{- define "kvstore.mebibytes" -}}
{{- printf "%dMi" (div (add (int64 .) 1048575) 1048576) -}}
{{- end -}}

{{/* sizeLimit of the /dev/shm emptyDir: L2 plus its headroom. */}}
{{- define "kvstore.shmSizeLimit" -}}
{{- $l2 := include "kvstore.bytes" .Values.dram.size | int64 -}}
{{- $extra := include "kvstore.bytes" .Values.dram.shmHeadroom | int64 -}}
{{- include "kvstore.mebibytes" (add $l2 $extra) -}}
{{- end -}}

{{/* Size of an L3 volume the chart sizes itself: the L3 file plus 1Gi for its manifest. */}}
{{- define "kvstore.l3VolumeSize" -}}
{{- include "kvstore.mebibytes" (add (include "kvstore.bytes" .Values.nvme.size | int64) 1073741824) -}}
{{- end -}}

{{/* "true" when L4 is on (an external address or the bundled Redis), else "". */}}
{{- define "kvstore.remote.enabled" -}}
{{- if or .Values.remote.enabled .Values.redis.enabled }}true{{ end -}}
{{- end -}}

{{/* host:port of the Redis L4 uses. */}}
{{- define "kvstore.remote.address" -}}
{{- if .Values.redis.enabled -}}
{{- printf "%s.%s.svc:6379" (include "kvstore.redis.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- .Values.remote.address -}}
{{- end -}}
{{- end -}}

{{/* The daemon's remote.url (no password: that comes from the Secret through the env). */}}
{{- define "kvstore.remote.url" -}}
{{- if include "kvstore.remote.enabled" . -}}
{{- printf "%s://%s/%d" (ternary "rediss" "redis" .Values.remote.tls) (include "kvstore.remote.address" .) (int .Values.remote.db) -}}
{{- end -}}
{{- end -}}

{{/* "true" when a Redis password is configured (a value or an existing Secret), else "". */}}
{{- define "kvstore.remote.hasPassword" -}}
{{- if or .Values.remote.existingSecret .Values.remote.password }}true{{ end -}}
{{- end -}}

{{/* "true" when the chart creates the Secret for the Redis password, else "". */}}
{{- define "kvstore.createSecret" -}}
{{- if and (include "kvstore.remote.enabled" .) .Values.remote.password (not .Values.remote.existingSecret) }}true{{ end -}}
{{- end -}}

{{/* Name of the Secret holding the Redis password. */}}
{{- define "kvstore.secretName" -}}
{{- default (include "kvstore.fullname" .) .Values.remote.existingSecret -}}
{{- end -}}

{{/* "true" when L2 is pinned CUDA memory (needs the IPC_LOCK capability), else "". */}}
{{- define "kvstore.pinsMemory" -}}
{{- if and .Values.dram.enabled .Values.dram.pinMemory .Values.hbm.enabled }}true{{ end -}}
{{- end -}}

{{/* The daemon container's securityContext: the values, plus only what pinning or GDS need. */}}
{{- define "kvstore.containerSecurityContext" -}}
{{- $ctx := deepCopy .Values.containerSecurityContext -}}
{{- if include "kvstore.pinsMemory" . -}}
{{- $caps := default (dict) $ctx.capabilities -}}
{{- $_ := set $caps "add" (append (default (list) $caps.add) "IPC_LOCK" | uniq) -}}
{{- $_ := set $ctx "capabilities" $caps -}}
{{- end -}}
{{- if .Values.nvme.gds.enabled -}}
{{- $_ := set $ctx "privileged" true -}}
{{- $_ := set $ctx "allowPrivilegeEscalation" true -}}
{{- end -}}
{{- toYaml $ctx -}}
{{- end -}}

{{/* The daemon container's resources: the values, plus nvidia.com/gpu when L1 is on. */}}
{{- define "kvstore.resources" -}}
{{- $res := deepCopy .Values.resources -}}
{{- if .Values.hbm.enabled -}}
{{- $gpus := int .Values.hbm.gpus -}}
{{- $_ := set $res "limits" (merge (dict "nvidia.com/gpu" $gpus) (default (dict) $res.limits)) -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* The daemon's YAML config file (kvstore/daemon/config/), built from values. */}}
{{- define "kvstore.config" -}}
{{- $v := .Values -}}
{{- $server := dict "host" "0.0.0.0" "port" (int $v.server.grpcPort) "workers" (int $v.server.workers)
      "max_streams" (int $v.server.maxStreams)
      "max_streams_per_connection" (int $v.server.maxStreamsPerConnection)
      "stream_idle_s" $v.server.streamIdleSeconds
      "max_message_bytes" (include "kvstore.daemonSize" $v.server.maxMessageSize)
      "chunk_bytes" (include "kvstore.daemonSize" $v.server.chunkSize)
      "max_object_bytes" (include "kvstore.daemonSize" $v.server.maxObjectSize)
      "max_response_bytes" (include "kvstore.daemonSize" $v.server.maxResponseSize)
      "max_batch_keys" (int $v.server.maxBatchKeys) "grace_s" $v.server.graceSeconds
      "drain_notice_s" $v.server.drainNoticeSeconds -}}
{{- $metrics := dict "enabled" $v.metrics.enabled "host" "0.0.0.0" "port" (int $v.metrics.port) -}}
{{- $hbm := dict "mode" (ternary "on" "off" $v.hbm.enabled) "device" 0
      "capacity_bytes" (include "kvstore.daemonSize" (default "0" $v.hbm.size))
      "fraction_of_free" $v.hbm.fractionOfFree
      "page_size_bytes" (include "kvstore.daemonSize" $v.hbm.pageSize) -}}
{{- $dram := dict "enabled" $v.dram.enabled
      "capacity_bytes" (include "kvstore.daemonSize" $v.dram.size)
      "page_size_bytes" (include "kvstore.daemonSize" $v.dram.pageSize)
      "pin_memory" (not (empty (include "kvstore.pinsMemory" .))) -}}
{{- with $v.dram.shmName }}{{ $_ := set $dram "shm_name" . }}{{ end -}}
{{- $nvme := dict "enabled" $v.nvme.enabled
      "capacity_bytes" (include "kvstore.daemonSize" $v.nvme.size)
      "page_size_bytes" (include "kvstore.daemonSize" $v.nvme.pageSize)
      "backend" (ternary "kvikio" $v.nvme.backend $v.nvme.gds.enabled)
      "io_threads" (int $v.nvme.ioThreads) "placement" $v.nvme.placement
      "admit_min_seen" (int $v.nvme.admitMinSeen) "sync" $v.nvme.sync -}}
{{- if $v.nvme.enabled }}{{ $_ := set $nvme "dir" $v.nvme.mountPath }}{{ end -}}
{{- $remote := dict "url" (include "kvstore.remote.url" .) "cluster" $v.remote.cluster
      "username" $v.remote.username "timeout_s" $v.remote.timeoutSeconds
      "ttl_s" $v.remote.ttlSeconds "compress" $v.remote.compress
      "queue_bytes" (include "kvstore.daemonSize" $v.remote.queueSize)
      "prewarm_bytes" (include "kvstore.daemonSize" $v.remote.prewarmSize) -}}
{{- $clients := dict "max_leases" (int $v.clients.maxLeases) "max_streams" (int $v.clients.maxStreams)
      "max_reservations" (int $v.clients.maxReservations)
      "max_reserved_share" $v.clients.maxReservedShare "max_pinned_share" $v.clients.maxPinnedShare
      "max_pin_s" $v.clients.maxPinSeconds -}}
{{- $managed := dict "server" $server "metrics" $metrics "hbm" $hbm "dram" $dram "nvme" $nvme
      "remote" $remote "clients" $clients "log_level" $v.server.logLevel -}}
{{- mergeOverwrite (deepCopy $v.extraConfig) $managed | toYaml -}}
{{- end -}}

{{/*
Fail early, with the --set that fixes it, on values the daemon or Kubernetes would reject later.
*/}}
{{- define "kvstore.validateValues" -}}
{{- $messages := list -}}
{{- $v := .Values -}}
{{- if and $v.nvme.enabled (not (has $v.nvme.volume.type (list "hostPath" "persistentVolumeClaim" "emptyDir"))) -}}
{{- $messages = append $messages (printf "kvstore: nvme.volume.type\n    L3 is on (nvme.enabled=true) but has no volume (nvme.volume.type=%q). Give it one:\n    --set nvme.volume.type=hostPath --set nvme.volume.hostPath.path=/mnt/nvme/kvstore\n    or turn L3 off: --set nvme.enabled=false" (toString $v.nvme.volume.type)) -}}
{{- end -}}
{{- if and $v.nvme.enabled (eq $v.nvme.volume.type "hostPath") (not $v.nvme.volume.hostPath.path) -}}
{{- $messages = append $messages "kvstore: nvme.volume.hostPath.path\n    L3 on a hostPath needs a node folder:\n    --set nvme.volume.hostPath.path=/mnt/nvme/kvstore" -}}
{{- end -}}
{{- if and $v.nvme.enabled (eq $v.nvme.volume.type "persistentVolumeClaim") (ne $v.kind "StatefulSet") -}}
{{- $messages = append $messages "kvstore: nvme.volume.type\n    A DaemonSet cannot give each daemon its own claim. Use a node folder or the StatefulSet mode:\n    --set nvme.volume.type=hostPath  or  --set kind=StatefulSet" -}}
{{- end -}}
{{- if and $v.nvme.enabled (not $v.dram.enabled) -}}
{{- $messages = append $messages "kvstore: dram.enabled\n    L3 needs L2 (blocks reach L3 through it):\n    --set dram.enabled=true  or  --set nvme.enabled=false" -}}
{{- end -}}
{{- if and $v.remote.enabled (not $v.redis.enabled) (not $v.remote.address) -}}
{{- $messages = append $messages "kvstore: remote.address\n    L4 is on (remote.enabled=true) but has no Redis address. Point it at Redis:\n    --set remote.address=redis-master.redis.svc:6379\n    or bundle a trial Redis: --set redis.enabled=true\n    or turn L4 off: --set remote.enabled=false" -}}
{{- end -}}
{{- if and $v.redis.enabled $v.remote.address -}}
{{- $messages = append $messages "kvstore: remote.address\n    Both the bundled Redis (redis.enabled=true) and an external one (remote.address) are set. Keep one:\n    --set redis.enabled=false  or  --set remote.address=" -}}
{{- end -}}
{{- $limit := include "kvstore.bytes" (dig "limits" "memory" "" ($v.resources | default dict)) -}}
{{- $l2 := include "kvstore.bytes" $v.dram.size -}}
{{- if and $v.dram.enabled $limit $l2 (ge (int64 $l2) (int64 $limit)) -}}
{{- $messages = append $messages (printf "kvstore: dram.size\n    L2 (dram.size=%s) lives in shared memory, which counts against the memory limit (resources.limits.memory=%s), so it must be smaller. Lower L2 or raise the limit:\n    --set dram.size=%s  or  --set resources.limits.memory=%s,resources.requests.memory=%s" $v.dram.size $v.resources.limits.memory (include "kvstore.mebibytes" (div (mul (int64 $limit) 3) 4)) (include "kvstore.mebibytes" (add $l2 2147483648)) (include "kvstore.mebibytes" (add $l2 2147483648))) -}}
{{- end -}}
{{- if and $v.nvme.gds.enabled (not $v.hbm.enabled) -}}
{{- $messages = append $messages "kvstore: nvme.gds.enabled\n    GPUDirect Storage needs a GPU (L1):\n    --set hbm.enabled=true  or  --set nvme.gds.enabled=false" -}}
{{- end -}}
{{- if and $v.nvme.gds.enabled (eq $v.image.variant "cpu") -}}
{{- $messages = append $messages "kvstore: image.variant\n    GPUDirect Storage needs the CUDA image:\n    --set image.variant=cuda" -}}
{{- end -}}
{{- if and $v.hbm.enabled (eq $v.image.variant "cpu") -}}
{{- $messages = append $messages "kvstore: image.variant\n    L1 (hbm.enabled=true) needs the CUDA image. Use it, or run without a GPU:\n    --set image.variant=cuda  or  --set hbm.enabled=false" -}}
{{- end -}}
{{- if le (int $v.terminationGracePeriodSeconds) (int $v.server.graceSeconds) -}}
{{- $messages = append $messages (printf "kvstore: terminationGracePeriodSeconds\n    The pod must outlive the daemon's drain (server.graceSeconds=%v):\n    --set terminationGracePeriodSeconds=%d" $v.server.graceSeconds (add (int $v.server.graceSeconds) 25)) -}}
{{- end -}}
{{- if gt (float64 $v.server.drainNoticeSeconds) (float64 $v.server.graceSeconds) -}}
{{- $messages = append $messages (printf "kvstore: server.drainNoticeSeconds\n    The drain notice is part of server.graceSeconds=%v:\n    --set server.drainNoticeSeconds=1" $v.server.graceSeconds) -}}
{{- end -}}
{{- if $messages -}}
{{- printf "\nVALUES VALIDATION:\n%s" (join "\n\n" $messages) | fail -}}
{{- end -}}
{{- end -}}
