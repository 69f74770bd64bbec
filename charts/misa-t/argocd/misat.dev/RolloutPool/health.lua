-- Argo CD health check of a RolloutPool (misat.dev/v1alpha1), from its kstatus conditions.
-- Install: the argocd-cm key resource.customizations.health.misat.dev_RolloutPool holds this
-- script (docs/operator.md, "GitOps"). health_test.yaml lists the cases the project tests.
local hs = {status = "Progressing", message = "Waiting for the operator to report on this generation"}
if obj.status == nil or obj.metadata == nil then
  return hs
end
local generation = obj.metadata.generation
if generation ~= nil and obj.status.observedGeneration ~= generation then
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end
local conditions = {}
if obj.status.conditions ~= nil then
  for _, c in ipairs(obj.status.conditions) do
    conditions[c.type] = c
  end
end
local function describe(c)
  local text = c.reason or ""
  if c.message ~= nil and c.message ~= "" then
    text = text .. ": " .. c.message
  end
  return text
end
local stalled, reconciling, ready = conditions["Stalled"], conditions["Reconciling"], conditions["Ready"]
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(stalled)
  return hs
end
if reconciling ~= nil and reconciling.status == "True" then
  hs.status = "Progressing"
  hs.message = describe(reconciling)
  return hs
end
if obj.spec ~= nil and obj.spec.engines ~= nil and obj.spec.engines.replicas == 0 then
  hs.status = "Suspended"
  hs.message = "Scaled to zero engines"
  return hs
end
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready)
  return hs
end
if ready ~= nil then
  hs.status = "Degraded"
  hs.message = describe(ready)
end
return hs
