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

{{/* "true" while image names the placeholder no registry serves (ghcr.io/example/kvstore), else "". */}}
{{- define "kvstore.image.isPlaceholder" -}}
{{- $ref := printf "%s/%s" .Values.image.registry .Values.image.repository | trimPrefix "/" -}}
{{- if eq $ref "ghcr.io/example/kvstore" }}true{{ end -}}
{{- end -}}

{{/* uid:gid the daemon container runs as (its securityContext, else the pod's, else the
     image's 10001): who must own the L3 folder and the socket folder. */}}
{{- define "kvstore.daemonOwner" -}}
{{- $ctr := .Values.containerSecurityContext | default dict -}}
{{- $pod := .Values.podSecurityContext | default dict -}}
{{- $uid := coalesce (get $ctr "runAsUser") (get $pod "runAsUser") 10001 -}}
{{- $gid := coalesce (get $ctr "runAsGroup") (get $pod "runAsGroup") (get $pod "fsGroup") 10001 -}}
{{- printf "%v:%v" $uid $gid -}}
{{- end -}}

{{/* "true" when the volume-permissions init container gives the L3 folder to the daemon:
     L3 on a hostPath (which fsGroup never reaches) and volumePermissions.enabled, else "". */}}
{{- define "kvstore.l3.chown" -}}
{{- if and .Values.volumePermissions.enabled .Values.nvme.enabled (eq .Values.nvme.volume.type "hostPath") }}true{{ end -}}
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

{{/* Bytes in a size, either spelling: a Kubernetes quantity (`64Gi`, `512Mi`, `10G`, `4096`)
     or the daemon's binary one (`64GiB`, `512MiB`); "" when not one of those. */}}
{{- define "kvstore.bytes" -}}
{{- $q := toString . -}}
{{- $num := regexFind "^[0-9]+" $q -}}
{{- $unit := trimPrefix $num $q -}}
{{- $factors := dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000
      "KiB" 1024 "MiB" 1048576 "GiB" 1073741824 "TiB" 1099511627776 -}}
{{- if and $num (hasKey $factors $unit) -}}
{{- mul (int64 $num) (get $factors $unit) -}}
{{- end -}}
{{- end -}}

{{/* A size in either spelling (`64Gi` or `64GiB`, `4096`) as the daemon writes it (`64GiB`,
     `4096`): kvstore/units.py reads `64GiB` but not `64Gi`. Tenant quotas go through it too,
     so they take the values' spelling as well. */}}
{{- define "kvstore.daemonSize" -}}
{{- $q := toString . -}}
{{- if regexMatch "(?i)[kmgt]i$" $q }}{{ printf "%sB" $q }}{{ else }}{{ $q }}{{ end -}}
{{- end -}}

{{/* A size in either spelling as a Kubernetes quantity (`64GiB` -> `64Gi`), for volume sizes. */}}
{{- define "kvstore.quantity" -}}
{{- $q := toString . -}}
{{- if regexMatch "[KMGT]iB$" $q }}{{ trimSuffix "B" $q }}{{ else }}{{ $q }}{{ end -}}
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

{{/* Size of an L3 volume the chart sizes itself, so that the daemon's start-up check passes
(kvstore/daemon/l3room.py): the L3 file; its manifest (two 256-byte records per page, plus a
journal of 100,000 records: 32Mi allowed); and the free space the daemon keeps on L3's
filesystem (10% of it, at least 1Gi): (file + manifest) x 10/9, plus 1Gi. */}}
{{- define "kvstore.l3VolumeSize" -}}
{{- $l3 := include "kvstore.bytes" .Values.nvme.size | int64 -}}
{{- $page := include "kvstore.bytes" .Values.nvme.pageSize | int64 -}}
{{- $manifest := add (div (mul $l3 512) $page) 33554432 -}}
{{- include "kvstore.mebibytes" (add (div (mul (add $l3 $manifest) 10) 9) 1073741824) -}}
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

{{/* auth.mode, with a YAML `off` that a values file read as false turned back into "off". */}}
{{- define "kvstore.auth.mode" -}}
{{- if eq (toString .Values.auth.mode) "false" }}off{{ else }}{{ .Values.auth.mode }}{{ end -}}
{{- end -}}

{{/* "true" when the daemon authenticates callers (auth.mode token or mtls), else "". */}}
{{- define "kvstore.auth.enabled" -}}
{{- if ne (include "kvstore.auth.mode" .) "off" }}true{{ end -}}
{{- end -}}

{{/* "true" when the chart writes the tenants file (auth on, no auth.existingSecret), else "". */}}
{{- define "kvstore.auth.generated" -}}
{{- if and (include "kvstore.auth.enabled" .) (not .Values.auth.existingSecret) }}true{{ end -}}
{{- end -}}

{{/* "true" when the chart also makes tenant `default` and its token (token mode, generated
     tenants file), else "". The daemon pod then holds an admin credential of its own. */}}
{{- define "kvstore.auth.ownToken" -}}
{{- if and (include "kvstore.auth.generated" .) (eq (include "kvstore.auth.mode" .) "token") }}true{{ end -}}
{{- end -}}

{{/* "true" when the chart also makes tenant `engine` (role client) and its token, the
     credential engine pods mount (token mode, generated tenants file, auth.engine.enabled). */}}
{{- define "kvstore.auth.engineToken" -}}
{{- if and (include "kvstore.auth.ownToken" .) .Values.auth.engine.enabled }}true{{ end -}}
{{- end -}}

{{/* The generated Secret with the token of tenant `engine` (key token), for engine pods. */}}
{{- define "kvstore.auth.engineTokenSecretName" -}}
{{- printf "%s-engine-token" (include "kvstore.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The Service's internalTrafficPolicy: service.internalTrafficPolicy, or "" = Local for a
     DaemonSet (Attach and shared memory need the engine's own node's daemon) and Cluster for
     a StatefulSet (its replicas are not one per node). */}}
{{- define "kvstore.service.trafficPolicy" -}}
{{- default (ternary "Local" "Cluster" (eq .Values.kind "DaemonSet")) .Values.service.internalTrafficPolicy -}}
{{- end -}}

{{/* The Secret with key tenants.yaml: auth.existingSecret, or the one the chart generates. */}}
{{- define "kvstore.auth.tenantsSecretName" -}}
{{- default (printf "%s-tenants" (include "kvstore.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* The generated Secret with the token of tenant `default` (key token), the admin's. */}}
{{- define "kvstore.auth.tokenSecretName" -}}
{{- printf "%s-token" (include "kvstore.fullname" .) -}}
{{- end -}}

{{/* What decides whether the daemon must restart for a tenants change: tenant names and
     quotas (credentials, namespaces and roles are re-read on SIGHUP instead). */}}
{{- define "kvstore.auth.tenantsShape" -}}
{{- $shape := list (include "kvstore.auth.mode" .) .Values.auth.existingSecret -}}
{{- if include "kvstore.auth.engineToken" . -}}
{{- $shape = append $shape (list "engine" .Values.auth.engine.quota) -}}
{{- end -}}
{{- range .Values.auth.tenants -}}
{{- $shape = append $shape (list (get . "name") (get . "quota")) -}}
{{- end -}}
{{- toJson $shape -}}
{{- end -}}

{{/* The name the chart's own clients expect in the server certificate. */}}
{{- define "kvstore.tls.serverName" -}}
{{- default (printf "%s.%s.svc" (include "kvstore.fullname" .) .Release.Namespace) .Values.tls.serverName -}}
{{- end -}}

{{/* "true" when the daemon has a Unix socket for Attach (auth on, L2 on, a node folder), else "". */}}
{{- define "kvstore.unixSocket.enabled" -}}
{{- if and (include "kvstore.auth.enabled" .) .Values.dram.enabled .Values.unixSocket.hostPath }}true{{ end -}}
{{- end -}}

{{/* "true" when the pod shares the node's IPC namespace: only with auth off, where L2 is one
     named /dev/shm segment; with auth on co-located clients get memfds over the socket. */}}
{{- define "kvstore.hostIPC" -}}
{{- if and .Values.dram.hostIPC (not (include "kvstore.auth.enabled" .)) }}true{{ end -}}
{{- end -}}

{{/* "true" when the preStop hook can drain through the API: Drain needs an admin, so with
     auth on only when the pod holds the generated admin token; else SIGTERM drains alone. */}}
{{- define "kvstore.preStopDrain" -}}
{{- if or (not (include "kvstore.auth.enabled" .)) (include "kvstore.auth.ownToken" .) }}true{{ end -}}
{{- end -}}

{{/* kvstore-admin's arguments for the chart's own calls (probes, preStop, helm test), as a
     JSON list: dict with ctx (the root), target, timeout (optional), token (add the
     mounted token file) and args (the verb and its flags). */}}
{{- define "kvstore.adminArgs" -}}
{{- $v := .ctx.Values -}}
{{- $out := list "--target" .target -}}
{{- with .timeout }}{{ $out = concat $out (list "--timeout" (toString .)) }}{{ end -}}
{{- if $v.tls.enabled -}}
{{- $out = concat $out (list "--tls-ca" "/etc/kvstore-tls/ca.crt" "--tls-server-name" (include "kvstore.tls.serverName" .ctx)) -}}
{{- if eq (include "kvstore.auth.mode" .ctx) "mtls" -}}
{{- /* mtls asks every handshake for a client certificate: the daemon's own pair serves
       (issue it for client auth too); health and the handshake need no tenant. */ -}}
{{- $out = concat $out (list "--tls-cert" "/etc/kvstore-tls/tls.crt" "--tls-key" "/etc/kvstore-tls/tls.key") -}}
{{- end -}}
{{- end -}}
{{- if .token }}{{ $out = concat $out (list "--token-file" "/etc/kvstore-token/token") }}{{ end -}}
{{- concat $out .args | toJson -}}
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
{{- if $v.server.dataPort -}}
{{- $_ := set $server "data_port" (int $v.server.dataPort) -}}
{{- end -}}
{{- if $v.tls.enabled -}}
{{- $_ := set $server "tls_cert_file" "/etc/kvstore-tls/tls.crt" -}}
{{- $_ := set $server "tls_key_file" "/etc/kvstore-tls/tls.key" -}}
{{- if eq (include "kvstore.auth.mode" .) "mtls" }}{{ $_ := set $server "tls_client_ca_file" "/etc/kvstore-tls/ca.crt" }}{{ end -}}
{{- end -}}
{{- /* StatefulSet replicas may share a node, hence its socket folder: each sets its own
       socket name through KVSTORE_SERVER_UNIX_SOCKET (_pod.tpl) instead. */ -}}
{{- if and (include "kvstore.unixSocket.enabled" .) (ne $v.kind "StatefulSet") -}}
{{- $_ := set $server "unix_socket" "/run/kvstore/kvstore.sock" -}}
{{- end -}}
{{- $auth := dict "mode" (include "kvstore.auth.mode" .) -}}
{{- if include "kvstore.auth.enabled" . }}{{ $_ := set $auth "tenants_file" "/etc/kvstore-auth/tenants.yaml" }}{{ end -}}
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
      "remote" $remote "clients" $clients "auth" $auth "log_level" $v.server.logLevel -}}
{{- mergeOverwrite (deepCopy $v.extraConfig) $managed | toYaml -}}
{{- end -}}

{{/* The label matchers every alerting rule adds to its series: prometheusRule.selector, or
     the labels the chart's ServiceMonitor gives this release's targets, or none. */}}
{{- define "kvstore.rules.selector" -}}
{{- if .Values.prometheusRule.selector -}}
{{- .Values.prometheusRule.selector -}}
{{- else if and .Values.metrics.enabled .Values.metrics.serviceMonitor.enabled -}}
{{- printf "job=%q,namespace=%q" (include "kvstore.fullname" .) .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/* A PromQL series selector: dict with ctx (the root), name and match (matchers, optional),
     plus the rules' selector. */}}
{{- define "kvstore.rules.series" -}}
{{- $matchers := compact (list (default "" .match) (include "kvstore.rules.selector" .ctx)) -}}
{{- printf "%s{%s}" .name (join "," $matchers) -}}
{{- end -}}

{{/*
Fail early, with the --set that fixes it, on values the daemon or Kubernetes would reject later.
*/}}
{{- define "kvstore.validateValues" -}}
{{- $messages := list -}}
{{- $v := .Values -}}
{{- if include "kvstore.image.isPlaceholder" . -}}
{{- $tag := default (printf "%s-%s" .Chart.AppVersion $v.image.variant) $v.image.tag -}}
{{- $messages = append $messages (printf "kvstore: image.repository\n    ghcr.io/example/kvstore is a placeholder: no registry serves a kvstore image. Build it from\n    docker/Dockerfile, push it to a registry your nodes pull from, and point the chart at it:\n    docker build -f docker/Dockerfile%s -t registry.example.com/ml/kvstore:%s .\n    docker push registry.example.com/ml/kvstore:%s\n    --set image.registry=registry.example.com --set image.repository=ml/kvstore\n    (docs/kubernetes.md, \"Build and push the image\")" (ternary " --build-arg VARIANT=cpu" "" (eq $v.image.variant "cpu")) $tag $tag) -}}
{{- end -}}
{{- if and $v.nvme.enabled (not (has $v.nvme.volume.type (list "hostPath" "persistentVolumeClaim" "emptyDir"))) -}}
{{- $messages = append $messages (printf "kvstore: nvme.volume.type\n    L3 is on (nvme.enabled=true) but has no volume (nvme.volume.type=%q). Give it one:\n    --set nvme.volume.type=hostPath --set nvme.volume.hostPath.path=/mnt/nvme/kvstore\n    or turn L3 off: --set nvme.enabled=false" (toString $v.nvme.volume.type)) -}}
{{- end -}}
{{- if and $v.nvme.enabled (eq $v.nvme.volume.type "hostPath") (not $v.nvme.volume.hostPath.path) -}}
{{- $messages = append $messages "kvstore: nvme.volume.hostPath.path\n    L3 on a hostPath needs a node folder:\n    --set nvme.volume.hostPath.path=/mnt/nvme/kvstore" -}}
{{- end -}}
{{- $owner := include "kvstore.daemonOwner" . -}}
{{- if and $v.nvme.enabled (eq $v.nvme.volume.type "hostPath") (not $v.volumePermissions.enabled) (eq (toString $v.nvme.volume.hostPath.type) "DirectoryOrCreate") -}}
{{- $messages = append $messages (printf "kvstore: volumePermissions.enabled\n    L3 is a hostPath (%s) of type DirectoryOrCreate: the kubelet creates it owned by root, fsGroup\n    does not apply to hostPath volumes, and the daemon (%s) could not write it. Let the chart\n    give it to the daemon:\n    --set volumePermissions.enabled=true\n    or create it on every node (install -d -o %s -g %s %s) and require it:\n    --set nvme.volume.hostPath.type=Directory" $v.nvme.volume.hostPath.path $owner (first (splitList ":" $owner)) (last (splitList ":" $owner)) $v.nvme.volume.hostPath.path) -}}
{{- end -}}
{{- if and $v.nvme.enabled (eq $v.nvme.volume.type "persistentVolumeClaim") (not (get ($v.podSecurityContext | default dict) "fsGroup")) -}}
{{- $messages = append $messages (printf "kvstore: podSecurityContext.fsGroup\n    L3 is a claim, whose filesystem the kubelet gives to the pod's fsGroup; without one the\n    daemon (%s) could not write it:\n    --set podSecurityContext.fsGroup=%s" $owner (last (splitList ":" $owner))) -}}
{{- end -}}
{{- if and (or $v.grafana.dashboard.enabled $v.prometheusRule.enabled) (not $v.metrics.enabled) -}}
{{- $messages = append $messages "kvstore: metrics.enabled\n    The Grafana dashboard and the alerting rules read the daemon's metrics, which are off:\n    --set metrics.enabled=true\n    or --set grafana.dashboard.enabled=false --set prometheusRule.enabled=false" -}}
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
{{- $mode := include "kvstore.auth.mode" . -}}
{{- if not (has $mode (list "off" "token" "mtls")) -}}
{{- $messages = append $messages (printf "kvstore: auth.mode\n    %q is not a mode:\n    --set auth.mode=token  or  --set auth.mode=mtls  or  --set auth.mode=off" $mode) -}}
{{- end -}}
{{- if and (eq $mode "mtls") (not $v.tls.enabled) -}}
{{- $messages = append $messages "kvstore: auth.mode\n    auth.mode=mtls names tenants by their client certificates, which needs TLS. Turn it on with a\n    kubernetes.io/tls Secret holding tls.crt, tls.key and ca.crt (the CA of the client certificates):\n    --set tls.enabled=true --set tls.secretName=kvstore-tls\n    or use bearer tokens: --set auth.mode=token" -}}
{{- end -}}
{{- if and $v.tls.enabled (not $v.tls.secretName) -}}
{{- $messages = append $messages "kvstore: tls.secretName\n    TLS is on (tls.enabled=true) but names no certificate. Give it a kubernetes.io/tls Secret\n    with tls.crt, tls.key and ca.crt:\n    --set tls.secretName=kvstore-tls  or  --set tls.enabled=false" -}}
{{- end -}}
{{- if and $v.dram.hostIPC (ne $mode "off") -}}
{{- $messages = append $messages (printf "kvstore: dram.hostIPC\n    With auth on (auth.mode=%s) each tenant's L2 is a private memfd arena handed out over the\n    Unix socket, so hostIPC is not needed and would only expose the node's IPC namespace:\n    --set dram.hostIPC=false  (or, without authentication: --set auth.mode=off)" $mode) -}}
{{- end -}}
{{- if and $v.auth.existingSecret $v.auth.tenants -}}
{{- $messages = append $messages "kvstore: auth.tenants\n    auth.tenants goes into the tenants file the chart generates, but auth.existingSecret\n    brings its own. Keep one: put the tenants in the Secret's tenants.yaml and --set auth.tenants=null,\n    or --set auth.existingSecret=" -}}
{{- end -}}
{{- if and (eq $mode "mtls") (not $v.auth.existingSecret) (not $v.auth.tenants) -}}
{{- $messages = append $messages "kvstore: auth.tenants\n    With auth.mode=mtls the generated tenants file has no tenant (tenant default is named by a\n    token, which mtls does not accept): list tenants with their certificate identities in\n    auth.tenants (docs/security.md), or --set auth.existingSecret=<Secret with tenants.yaml>" -}}
{{- end -}}
{{- if include "kvstore.auth.ownToken" . -}}
{{- range $v.auth.tenants -}}
{{- if eq (toString (get . "name")) "default" -}}
{{- $messages = append $messages "kvstore: auth.tenants\n    The chart already makes tenant \"default\" (role admin, the generated token). Rename yours:\n    auth.tenants[].name" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if include "kvstore.auth.engineToken" . -}}
{{- if not $v.auth.engine.namespaces -}}
{{- $messages = append $messages "kvstore: auth.engine.namespaces\n    Tenant engine is a client and must own a namespace prefix:\n    --set-json 'auth.engine.namespaces=[\"\"]'  or  --set auth.engine.enabled=false" -}}
{{- end -}}
{{- range $t := $v.auth.tenants -}}
{{- if eq (toString (get $t "name")) "engine" -}}
{{- $messages = append $messages "kvstore: auth.tenants\n    The chart already makes tenant \"engine\" (role client, Secret <fullname>-engine-token). Rename\n    yours (auth.tenants[].name), or drop the chart's: --set auth.engine.enabled=false" -}}
{{- end -}}
{{- range $mine := $v.auth.engine.namespaces -}}
{{- range $theirs := (get $t "namespaces" | default list) -}}
{{- if or (hasPrefix (toString $mine) (toString $theirs)) (hasPrefix (toString $theirs) (toString $mine)) -}}
{{- $messages = append $messages (printf "kvstore: auth.engine.namespaces\n    Tenant engine owns %q, which overlaps %q of tenant %q (auth.tenants); the daemon\n    refuses overlapping owners. Give engine a prefix of its own, or drop it when every engine\n    has its own tenant:\n    --set-json 'auth.engine.namespaces=[\"engine/\"]'  or  --set auth.engine.enabled=false" (toString $mine) (toString $theirs) (toString (get $t "name"))) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $v.auth.extraTokenHashes (not (include "kvstore.auth.ownToken" .)) -}}
{{- $messages = append $messages "kvstore: auth.extraTokenHashes\n    These hashes belong to the generated tenant default, which exists only with auth.mode=token\n    and no auth.existingSecret. Put them in your tenants file instead:\n    --set auth.extraTokenHashes=null" -}}
{{- end -}}
{{- if $messages -}}
{{- printf "\nVALUES VALIDATION:\n%s" (join "\n\n" $messages) | fail -}}
{{- end -}}
{{- end -}}
